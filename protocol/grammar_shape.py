"""Grammars that can never finish, found in pure Python before llama.cpp runs them.

`root ::= x` with `x ::= "a" x "b" | "a" x "c"` parses, yet no finite text matches x: every
alternative recurses. llama.cpp follows it anyway and keeps one parse stack per reading of
the output so far, twice as many per character; a 38-byte grammar froze a worker for good.
A rule that can derive a finite text is *productive* (a terminal is; a sequence
is when each of its items is or may be left out; a rule is when one alternative is); every
rule reachable from `root` must be. The gateway refuses such a grammar with a 400 and the
worker refuses it from any peer, as they do protocol.limits' checks; run those first, they
bound the size this walks. Grammars llama.cpp cannot parse pass here: its parser says why.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from .limits import _GBNF_TOKEN

_OPTIONAL_OPS = frozenset({"*", "?"})


@dataclass(slots=True)
class _Rule:
    """A rule flattened as llama.cpp flattens it: a group becomes a rule of its own."""

    name: str  # the rule it is written in, for messages
    alternatives: list[list[tuple[str | None, bool]]] = field(default_factory=lambda: [[]])
    # each item: (the rule it refers to, or None for a terminal; whether it may be left out)


def grammar_shape_problem(grammar: str) -> str | None:
    """Why this grammar can never finish, or None (also when it does not parse)."""
    rules = _flatten(grammar)
    if rules is None or "root" not in rules:
        return None
    productive = _productive(rules)
    reachable = _reachable(rules, "root")
    stuck = sorted({rules[key].name for key in reachable if key not in productive})
    if not stuck:
        return None
    names = ", ".join(f"`{name}`" for name in stuck[:5])
    which = f"rule {names} matches" if len(stuck) == 1 else f"rules {names} match"
    return (
        f"the grammar can never finish: {which} no finite text (every alternative recurses "
        f"without end); give each rule an alternative that ends"
    )


def _flatten(grammar: str) -> dict[str, _Rule] | None:
    """Every rule, groups as rules of their own keyed `rule#n`; None when it does not parse."""
    tokens = [
        (t.lastgroup, t.group(), t)
        for t in _GBNF_TOKEN.finditer(grammar)
        if t.lastgroup != "comment"
    ]
    rules: dict[str, _Rule] = {}
    groups: list[_Rule] = []  # the open groups, innermost last; [0] is the rule itself
    n_groups = 0
    for i, (kind, text, token) in enumerate(tokens):
        starts_rule = i + 1 < len(tokens) and tokens[i + 1][1] == "::="
        if kind == "atom" and starts_rule and text[0] != "<":
            if len(groups) > 1:
                return None  # a group left open
            rule = rules.get(text)
            if rule is None:
                rule = rules[text] = _Rule(text)
            groups = [rule]
            continue
        if text == "::=":
            continue
        if not groups:
            return None  # something before the first rule
        current = groups[-1].alternatives
        if kind in ("chars", "atom") and (text[0] in '"[<' or text == "."):
            current[-1].append((None, False))
        elif kind == "atom" and text == "|":
            current.append([])
        elif kind == "atom":
            current[-1].append((text, False))
        elif kind == "repeat":
            if not current[-1]:
                return None
            if int(token["min"] or 0) == 0:
                current[-1][-1] = (current[-1][-1][0], True)
        elif text == "(":
            n_groups += 1
            key = f"{groups[0].name}#{n_groups}"
            current[-1].append((key, False))
            groups.append(rules.setdefault(key, _Rule(groups[0].name)))  # a new key
        elif text == ")":
            if len(groups) < 2:
                return None
            groups.pop()
        elif text in _OPTIONAL_OPS:
            if not current[-1]:
                return None
            current[-1][-1] = (current[-1][-1][0], True)
        # `+` and `{m,n}` with m > 0 keep their item required
    return rules if len(groups) <= 1 else None


def _productive(rules: dict[str, _Rule]) -> set[str]:
    """The rules that derive some finite text: a worklist over the required references."""
    productive: set[str] = set()
    waiting: list[int] = []  # per alternative: required references not yet known productive
    owners: list[str] = []  # per alternative: its rule
    users: dict[str, list[int]] = defaultdict(list)  # rule -> alternatives that require it
    ready: deque[str] = deque()
    for key, rule in rules.items():
        for alternative in rule.alternatives:
            index = len(waiting)
            required = {ref for ref, optional in alternative if ref is not None and not optional}
            required = {ref for ref in required if ref in rules}  # an undefined one: the parser
            waiting.append(len(required))
            owners.append(key)
            for ref in required:
                users[ref].append(index)
            if not required:
                ready.append(key)
    while ready:
        key = ready.popleft()
        if key in productive:
            continue
        productive.add(key)
        for index in users[key]:
            waiting[index] -= 1
            if waiting[index] == 0:
                ready.append(owners[index])
    return productive


def _reachable(rules: dict[str, _Rule], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for alternative in rules[todo.pop()].alternatives:
            for ref, _ in alternative:
                if ref is not None and ref in rules and ref not in seen:
                    seen.add(ref)
                    todo.append(ref)
    return seen
