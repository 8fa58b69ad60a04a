"""compressed-tensors' module-name patterns ("re:<regular expression>" in a quantization_config's `targets` and
`ignore`), matched in time linear in the name.

A checkpoint's config.json is input from elsewhere, and Python's `re` backtracks: a pattern such as "re:(a+)+$"
takes time exponential in the length of a name it almost matches (30 characters: minutes). compile_pattern parses
the expression with Python's own parser, so the syntax and the meaning are re.match's (the name must match from its
start, not to its end), and runs it as a Thompson automaton: each character of the name is read once, against the
set of states the expression can be in, so a match costs at most len(name) x states steps whatever the pattern.

    match = compile_pattern(r".*mlp\\.gate$")   # ValueError for a pattern it does not take
    match("model.layers.0.mlp.gate")            # True, as re.match(r".*mlp\\.gate$", ...) says

Regular expressions as compressed-tensors and llmcompressor write them (".*lm_head", "model.layers.\\d+.mlp.gate$",
".*self_attn.(q|k|v)_proj$", character classes, anchors, bounded and unbounded repeats, alternatives) are taken.
Refused, with the reason: what is not a regular expression in the strict sense (backreferences, lookahead and
lookbehind, conditionals, atomic groups, possessive repeats), inline flags ((?i) ...), patterns longer than
MAX_PATTERN_CHARS characters, and patterns whose automaton would exceed MAX_STATES states (a{1000}{1000}).
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Set

try:  # Python 3.11+
    from re import _constants as _c, _parser as _sre
except ImportError:  # Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _sre  # type: ignore[no-redef]

__all__ = ["MAX_PATTERN_CHARS", "MAX_STATES", "compile_pattern"]

MAX_PATTERN_CHARS = 1000  # patterns real checkpoints carry are tens of characters
MAX_STATES = 2000  # states of the automaton (a character test, a branch or an anchor each)
_CACHE_STEPS = 4096  # steps (state set, character, anchor context) kept per pattern

_CHAR, _SPLIT, _AT, _ACCEPT = range(4)
_REFUSED = {  # constructs a finite automaton cannot run, and what to call them
    "GROUPREF": "a backreference", "GROUPREF_IGNORE": "a backreference", "GROUPREF_EXISTS": "a conditional",
    "ASSERT": "a lookahead or lookbehind", "ASSERT_NOT": "a lookahead or lookbehind",
    "ATOMIC_GROUP": "an atomic group", "POSSESSIVE_REPEAT": "a possessive repeat",
}
_ANCHORS = ("AT_BEGINNING", "AT_BEGINNING_STRING", "AT_END", "AT_END_STRING", "AT_BOUNDARY", "AT_NON_BOUNDARY")
_FLAGS_TAKEN = _c.SRE_FLAG_UNICODE | _c.SRE_FLAG_VERBOSE  # the default for a str pattern; (?x) only changes parsing


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


_CATEGORIES = {  # str patterns: re's Unicode meaning of \d, \s, \w
    "CATEGORY_DIGIT": str.isdecimal, "CATEGORY_SPACE": str.isspace, "CATEGORY_WORD": _is_word,
    "CATEGORY_NOT_DIGIT": lambda ch: not ch.isdecimal(), "CATEGORY_NOT_SPACE": lambda ch: not ch.isspace(),
    "CATEGORY_NOT_WORD": lambda ch: not _is_word(ch),
}


class _Automaton:
    """A Thompson automaton built from re's parse tree, back to front: each construct is compiled with the state
    that follows it already known."""

    def __init__(self, pattern: str):
        self.states: list = []
        tree = _sre.parse(pattern, 0)
        flags = tree.state.flags & ~_FLAGS_TAKEN
        if flags:
            raise ValueError("it sets flags ((?i), (?s), (?m), ...), which compressed-tensors patterns do not use")
        self._cache: dict = {}  # match's steps (see there)
        self.accept = self._add((_ACCEPT,))
        self.start = self._seq(list(tree), self.accept)

    def _add(self, state: tuple) -> int:
        if len(self.states) >= MAX_STATES:
            raise ValueError(f"its automaton needs more than {MAX_STATES} states (repeats of repeats)")
        self.states.append(state)
        return len(self.states) - 1

    def _seq(self, items: list, nxt: int) -> int:
        for op, av in reversed(items):
            nxt = self._one(op, av, nxt)
        return nxt

    def _one(self, op, av, nxt: int) -> int:
        name = op.name
        if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN"):
            return self._add((_CHAR, _char_test(name, av), nxt))
        if name == "SUBPATTERN":
            _, add_flags, del_flags, items = av
            if add_flags & ~_FLAGS_TAKEN or del_flags & ~_FLAGS_TAKEN:
                raise ValueError("it sets flags in a group ((?i:...), ...), which compressed-tensors patterns do "
                                 "not use")
            return self._seq(list(items), nxt)
        if name == "BRANCH":
            return self._add((_SPLIT, [self._seq(list(alt), nxt) for alt in av[1]]))
        if name in ("MAX_REPEAT", "MIN_REPEAT"):  # greedy or lazy: the same set of matches
            low, high, items = av
            start = nxt
            if high == _c.MAXREPEAT:  # unbounded: a loop that returns to a branch before each pass
                start = loop = self._add((_SPLIT, []))
                self.states[loop] = (_SPLIT, [self._seq(list(items), loop), nxt])
            else:
                for _ in range(high - low):  # each optional pass may stop the repeat
                    start = self._add((_SPLIT, [self._seq(list(items), start), nxt]))
            for _ in range(low):
                start = self._seq(list(items), start)
            return start
        if name == "AT":
            if av.name not in _ANCHORS:
                raise ValueError(f"it uses the anchor {av.name}, which fp8ext does not match")
            return self._add((_AT, av.name, nxt))
        raise ValueError(f"it uses {_REFUSED.get(name, name)}, which a regular expression matched without "
                         "backtracking cannot have")

    def _closure(self, states: Set[int], s: str, pos: int) -> Set[int]:
        """The states reached from `states` at position `pos` of `s` without reading a character."""
        seen, stack, out = set(), list(states), set()
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            st = self.states[i]
            if st[0] == _SPLIT:
                stack.extend(st[1])
            elif st[0] == _AT:
                if _at(st[1], s, pos):
                    stack.append(st[2])
            else:
                out.add(i)
        return out

    def match(self, s: str) -> bool:
        """Whether the automaton matches a prefix of s (re.match). The sets of states it steps through are cached
        per (set, character, what the anchors can see there), as a lazily built DFA (RE2's way): a pattern whose
        state sets are large costs that once per distinct step, not once per character of every name."""
        n, cache = len(s), self._cache
        current = frozenset(self._closure({self.start}, s, 0))
        for pos, ch in enumerate(s):
            if self.accept in current:
                return True
            nxt_pos = pos + 1
            key = (current, ch, nxt_pos == n, nxt_pos == n - 1 and s[-1] == "\n",
                   nxt_pos < n and _is_word(s[nxt_pos]))
            nxt = cache.get(key)
            if nxt is None:
                nxt = frozenset(self._closure({self.states[i][2] for i in current
                                               if self.states[i][0] == _CHAR and self.states[i][1](ch)}, s, nxt_pos))
                if len(cache) >= _CACHE_STEPS:
                    cache.clear()
                cache[key] = nxt
            current = nxt
            if not current:
                return False
        return self.accept in current


def _char_test(name: str, av) -> Callable[[str], bool]:
    if name == "LITERAL":
        return lambda ch: ord(ch) == av
    if name == "NOT_LITERAL":
        return lambda ch: ord(ch) != av
    if name == "ANY":
        return lambda ch: ch != "\n"
    negate, tests = False, []
    for op, arg in av:
        kind = op.name
        if kind == "NEGATE":
            negate = True
        elif kind == "LITERAL":
            tests.append(lambda ch, c=arg: ord(ch) == c)
        elif kind == "RANGE":
            tests.append(lambda ch, lo=arg[0], hi=arg[1]: lo <= ord(ch) <= hi)
        elif kind == "CATEGORY" and arg.name in _CATEGORIES:
            tests.append(_CATEGORIES[arg.name])
        else:
            raise ValueError(f"its character class holds {kind} {arg}, which fp8ext does not match")
    return lambda ch: any(t(ch) for t in tests) != negate


def _at(kind: str, s: str, pos: int) -> bool:
    """re's anchors (no MULTILINE): ^ and \\A at the start; $ at the end or before a final newline; \\Z at the end;
    \\b and \\B between word and non-word characters (never in an empty string)."""
    if kind in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
        return pos == 0
    if kind == "AT_END":
        return pos == len(s) or (pos == len(s) - 1 and s[-1] == "\n")
    if kind == "AT_END_STRING":
        return pos == len(s)
    if kind in ("AT_BOUNDARY", "AT_NON_BOUNDARY"):
        if not s:
            return False
        before = pos > 0 and _is_word(s[pos - 1])
        after = pos < len(s) and _is_word(s[pos])
        return (before != after) == (kind == "AT_BOUNDARY")
    raise AssertionError(kind)  # _Automaton takes only _ANCHORS


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> Callable[[str], bool]:
    """name -> whether re.match(pattern, name) matches, computed without backtracking; ValueError saying why for
    a pattern this does not take (see the module docstring)."""
    if not isinstance(pattern, str):
        raise TypeError(f"a pattern must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"it is {len(pattern)} characters long; patterns are at most {MAX_PATTERN_CHARS}")
    try:
        automaton = _Automaton(pattern)
    except re.error as e:
        raise ValueError(f"it is not a regular expression ({e})") from None
    except RecursionError:
        raise ValueError("its groups are nested too deeply") from None
    return automaton.match
