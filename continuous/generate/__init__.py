"""Sequence generators, one small module per kind (as in outlines v0)."""

from .base import SequenceGenerator
from .cfg import cfg
from .choice import choice
from .format import format
from .json import json
from .regex import regex
from .text import text
from .tools import tools

__all__ = ["SequenceGenerator", "text", "choice", "json", "regex", "format", "cfg", "tools"]
