"""Chat templates of real model families that the test tokenizers do not ship.

``QWEN25`` is Qwen2.5-Instruct's template (Apache-2.0): it renders ``tools`` and asks for
Hermes-style calls, ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

#: An abbreviated template in the form of Llama 3.1's: it renders ``tools`` in the user's
#: last message and asks for a reply that is one JSON call with ``"parameters"``.
LLAMA31_FORM = """{{- bos_token }}
{%- for message in messages %}
    {%- if loop.last and tools and message.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
        {%- for t in tools %}
            {{- t | tojson }}
            {{- "\\n\\n" }}
        {%- endfor %}
        {{- message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

#: An abbreviated template in the form of Mistral's: ``[AVAILABLE_TOOLS]`` before the last
#: user message, calls as ``[TOOL_CALLS]`` and a JSON list.
MISTRAL_FORM = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if loop.last and tools %}
            {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.tool_calls %}
            {{- '[TOOL_CALLS]' + (message.tool_calls | tojson) }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""
