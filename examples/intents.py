"""Intent detection over 10 labels, with a probability for every label, calibrated.

``generate.choice(model, labels, scores=True)`` gives, besides the chosen label, every
label's log-probability after the prompt (``state.choice_scores``): the prompt is
forwarded once and the 10 labels together in one batched forward. Normalized over the
labels, they are the model's probabilities for each intent.

A small model has priors of its own: some labels (short ones, common words) get mass
whatever the message. Contextual calibration (Zhao et al., 2021, "Calibrate before
use") measures that prior with content-free messages (``"N/A"``, ``""``, ``"[MASK]"``)
and divides it out, so a label wins by what the message says. The script prints both,
with accuracy on a small labelled set.

Run ``python examples/intents.py [--model PATH_OR_HUB_NAME] [--quick]``; the default model
is SmolLM2-135M-Instruct from the Hugging Face hub.
"""

import argparse
import math

import torch

from continuous import chat, continuous, generate, models

LABELS = ["weather", "alarm", "music", "timer", "reminder", "calendar", "news", "translation",
          "shopping list", "lights"]

MESSAGES = [
    ("Will it rain in Paris tomorrow?", "weather"),
    ("Wake me up at 6:30 tomorrow morning.", "alarm"),
    ("Play some jazz, please.", "music"),
    ("Set a timer for ten minutes.", "timer"),
    ("Remind me to call my mother tonight.", "reminder"),
    ("What meetings do I have on Friday?", "calendar"),
    ("What are today's headlines?", "news"),
    ("How do you say 'thank you' in Japanese?", "translation"),
    ("Add milk and eggs to my shopping list.", "shopping list"),
    ("Turn off the lights in the kitchen.", "lights"),
    ("Do I need an umbrella today?", "weather"),
    ("Skip this song.", "music"),
    ("How long is left on my pasta timer?", "timer"),
    ("Put the dentist appointment on my calendar for Monday at 3.", "calendar"),
    ("Translate 'where is the station' into German.", "translation"),
    ("Dim the bedroom lights to 30 percent.", "lights"),
    ("Any news about the election?", "news"),
    ("Don't let me forget to water the plants.", "reminder"),
    ("Cancel my 7 am alarm.", "alarm"),
    ("We are out of bread, put it on the list.", "shopping list"),
]

CONTENT_FREE = ["N/A", "", "[MASK]"]


def prompt(model, message: str) -> str:
    instruction = (f"Classify the user's message into one of these intents: {', '.join(LABELS)}.\n"
                   f"Message: {message}\nAnswer with the intent only.")
    return chat.prompt(model, [{"role": "user", "content": instruction}])


def normalized(scores: dict[str, float]) -> dict[str, float]:
    """Log-probabilities of the labels made probabilities that sum to 1 over the labels."""
    top = max(scores.values())
    weights = {label: math.exp(s - top) for label, s in scores.items()}
    total = sum(weights.values())
    return {label: w / total for label, w in weights.items()}


def calibrated(probs: dict[str, float], prior: dict[str, float]) -> dict[str, float]:
    """``probs`` with the content-free prior divided out, summing to 1 again."""
    ratio = {label: p / prior[label] for label, p in probs.items()}
    total = sum(ratio.values())
    return {label: r / total for label, r in ratio.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="the first 10 messages only")
    args = parser.parse_args()

    model = models.transformers(args.model, dtype=torch.float32)
    gen = continuous(generate.choice(model, LABELS, scores=True))
    messages = MESSAGES[:10] if args.quick else MESSAGES

    # One call for every message and the content-free ones: each prompt is forwarded once,
    # then all 10 labels of every row in one batched forward.
    before = model.stats.snapshot()
    state = gen([prompt(model, m) for m, _ in messages] + [prompt(model, m) for m in CONTENT_FREE])
    spent = model.stats.forward_calls - before["forward_calls"]
    probs = [normalized(s) for s in state.choice_scores]
    rows, free = probs[: len(messages)], probs[len(messages):]
    prior = {label: sum(p[label] for p in free) / len(free) for label in LABELS}
    print("content-free prior:", ", ".join(f"{label} {prior[label]:.2f}" for label in LABELS))

    right_raw = right_cal = 0
    for (message, truth), raw, chosen in zip(messages, rows, state.value):
        cal = calibrated(raw, prior)
        best_raw, best_cal = max(raw, key=raw.get), max(cal, key=cal.get)
        right_raw += best_raw == truth
        right_cal += best_cal == truth
        print(f"{message!r} (intent: {truth})\n  generated: {chosen}; raw: {best_raw} {raw[best_raw]:.2f}; "
              f"calibrated: {best_cal} {cal[best_cal]:.2f}; p(truth) {raw[truth]:.2f} -> {cal[truth]:.2f}")
    print(f"accuracy: raw {right_raw}/{len(messages)}, calibrated {right_cal}/{len(messages)}")
    print(f"{len(state.choice_scores)} prompts x {len(LABELS)} labels scored; {spent} forward calls in all")


if __name__ == "__main__":
    main()
