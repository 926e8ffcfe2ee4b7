"""The rules layer: per-category deny patterns, with allow patterns that carve out exceptions.

Pure regular expressions, no model. Spans matching `allow[category]` (or `allow["*"]`) are
blanked before that category's deny patterns run, so an exception never unlocks text next to
it. The built-in patterns below target unambiguous requests only; the classifier does the rest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from settings import ConfigError

ALL_CATEGORIES = "*"  # an allow key that applies to every category

_GAP = r"[^.?!\n]{0,30}"  # a short gap inside one sentence; keeps matches under ~100 chars
_ASK = (
    r"(?:how (?:do|can|could|would|should|to)(?: i| we| you| one)?|teach me|show me|tell me how|"
    r"give me|walk me through|instructions? (?:for|to|on)|step[- ]by[- ]step|recipe for|guide (?:to|for|on))"
)
_MAKE = r"(?:make|making|build|building|assemble|construct|synthesi[sz]e|produce|manufacture|weaponi[sz]e)"
_ARMS = (
    r"(?:pipe ?bombs?|nail ?bombs?|car ?bombs?|letter ?bombs?|(?:suicide|bomb) vests?|ieds?|"
    r"improvised explosive devices?|molotov(?: cocktail)?s?|napalm|sarin|nerve (?:agent|gas)s?|ricin|"
    r"anthrax|mustard gas|dirty bombs?|tatp|pressure[- ]cooker bombs?|auto ?sears?|glock switch(?:es)?)"
)
_SUICIDE = r"(?:kill myself|end my life|commit suicide|hang myself|end it all)"
_MINOR = (
    r"(?:child|children|kids?|minors?|toddlers?|pre-?teens?|underage|little (?:girl|boy)s?|"
    r"(?:[1-9]|1[0-7])[- ]?(?:years?|yrs?)[- ]?old|(?:[1-9]|1[0-7]) ?yo|(?:fifth|sixth|seventh|7th|6th|5th) grade\w*)"
)
_SEXUAL = r"(?:sex|sexual|sexy|erotic|erotica|nude|nudes|naked|porn|lewd|nsfw|smut|steamy)\w*"
_GROUP = (
    r"(?:jews|muslims|blacks|black people|gays|gay people|immigrants|refugees|arabs|asians|mexicans|"
    r"christians|trans(?:gender)? people|women|roma|gypsies|hindus|sikhs|latinos|africans)"
)

# Built-in deny patterns, applied to prompts only (they are phrased as requests), matched
# case-insensitively. Listed in config.toml's comments; `builtin_rules = false` turns them off.
BUILTIN_DENY: dict[str, tuple[str, ...]] = {
    "weapons": (
        rf"\b{_ASK}\b{_GAP}\b{_MAKE}\b{_GAP}\b{_ARMS}\b",
        rf"\b{_ASK}\b{_GAP}\bconvert\b{_GAP}\bfull(?:y)?[- ]?auto(?:matic)?\b",
    ),
    "self_harm": (
        rf"\b(?:best|easiest|quickest|fastest|painless|surest|least painful|most reliable)\b[^.?!\n]{{0,20}}"
        rf"\b(?:ways?|methods?)\b[^.?!\n]{{0,10}}\bto\b[^.?!\n]{{0,10}}\b{_SUICIDE}\b",
        rf"\bhow (?:do|can|should) i\b[^.?!\n]{{0,20}}\b{_SUICIDE}\b",
        r"\bhow (?:many|much)\b[^.?!\n]{0,40}\b(?:would|will|to|does it take to|do i need to)\s+"
        r"(?:kill me|end my life|make sure i (?:die|don'?t wake up)|not wake up)\b",
    ),
    "malware": (
        r"\b(?:write|code|create|build|make|develop)\s+(?:me\s+)?(?:an?\s+|some\s+|the\s+)?"
        r"(?:(?:working|functional|fully working|python|simple|undetectable|windows)\s+)*"
        r"(?:ransomware|keyloggers?|credential stealers?|password stealers?|token grabbers?|"
        r"crypto ?drainers?|rootkits?|botnets?|computer virus(?:es)?)\b",
        r"\bhow (?:do|can|could) i\b[^.?!\n]{0,20}\b(?:hack|break) into\b[^.?!\n]{0,20}"
        r"\b(?:my (?:ex|girlfriend|boyfriend|wife|husband|roommate|neighbou?r|teacher|boss)|someone|his|her)\b",
    ),
    "sexual_minors": (
        rf"\b{_SEXUAL}\b[^.?!\n]{{0,50}}\b{_MINOR}\b",
        rf"\b{_MINOR}\b[^.?!\n]{{0,50}}\b{_SEXUAL}\b",
    ),
    "hate": (
        rf"\b{_GROUP}\b[^.?!\n]{{0,30}}\b(?:should|must|need to|deserve to|ought to) (?:all )?(?:be )?"
        r"(?:killed|exterminated|gassed|burned|lynched|wiped out|eradicated|shot|sterili[sz]ed|stoned)\b",
        rf"\b(?:write|compose|create|generate|make)\b[^.?!\n]{{0,40}}\b{_GROUP}\b[^.?!\n]{{0,20}}"
        r"\b(?:are|is)\b[^.?!\n]{0,10}"
        r"\b(?:vermin|subhuman|sub-human|animals|rats|apes|cockroaches|parasites|filth|inferior)\b",
    ),
}

# Built-in exceptions: protective and educational phrasings that the deny patterns above would
# otherwise catch ("report child sexual abuse", "sex education for kids").
BUILTIN_ALLOW: dict[str, tuple[str, ...]] = {
    "sexual_minors": (
        r"\bsex(?:ual|ually)? (?:abus\w*|assault\w*|exploit\w*|education|ed|predators?|offenders?|harass\w*|health)\b",
        r"\b(?:detect|report|prevent|combat|fight|flag|recogni[sz]e|protect)\w*\b[^.?!\n]{0,40}"
        r"\b(?:child (?:porn\w*|sexual abuse material)|csam)\b",
    ),
}


@dataclass(frozen=True, slots=True)
class RuleMatch:
    category: str
    start: int  # character offsets into the text that was scanned
    end: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    """`match`: a complete deny match, or None. `pending_start`: where the earliest match that
    touches the end of the text begins (more text could still change it), or None."""

    match: RuleMatch | None
    pending_start: int | None


class RuleSet:
    """Compiled deny and allow patterns per category."""

    def __init__(self, deny: Mapping[str, Sequence[str]], allow: Mapping[str, Sequence[str]]):
        self._deny = {c: [_compile(p, f"deny.{c}") for p in ps] for c, ps in deny.items() if ps}
        self._allow = {c: [_compile(p, f"allow.{c}") for p in ps] for c, ps in allow.items() if ps}

    @classmethod
    def merged(cls, deny: Mapping[str, Sequence[str]], allow: Mapping[str, Sequence[str]], *, builtin: bool) -> RuleSet:
        """Operator patterns, plus the built-in ones when `builtin`."""
        if builtin:
            deny, allow = _merge(BUILTIN_DENY, deny), _merge(BUILTIN_ALLOW, allow)
        return cls(deny, allow)

    @property
    def is_empty(self) -> bool:
        return not self._deny

    @property
    def categories(self) -> tuple[str, ...]:
        """The categories that have deny patterns, in declaration order."""
        return tuple(self._deny)

    def first_match(self, text: str) -> RuleMatch | None:
        """The first complete deny match in `text`, categories in declaration order."""
        return self.scan(text, 0, final=True).match

    def matched_categories(self, text: str) -> tuple[str, ...]:
        """Every category with a complete deny match in `text`, in declaration order (the first
        is first_match's)."""
        matched = []
        for category, patterns in self._deny.items():
            masked = self._mask(text, category)
            if any(pattern.search(masked) for pattern in patterns):
                matched.append(category)
        return tuple(matched)

    def scan(self, text: str, pos: int, *, final: bool) -> ScanResult:
        """Deny matches starting at or after `pos` (earlier text gives \\b its context).

        Unless `final`, a match ending exactly at the end of `text` is not yet a match: the
        next characters could extend or break it ("bomb" -> "bombastic")."""
        pending: int | None = None
        for category, patterns in self._deny.items():
            masked = self._mask(text, category)
            for pattern in patterns:
                for m in pattern.finditer(masked, pos):
                    if final or m.end() < len(text):
                        return ScanResult(RuleMatch(category, m.start(), m.end()), None)
                    pending = m.start() if pending is None else min(pending, m.start())
        return ScanResult(None, pending)

    def _mask(self, text: str, category: str) -> str:
        """`text` with this category's allowed spans blanked, offsets unchanged."""
        patterns = self._allow.get(category, []) + self._allow.get(ALL_CATEGORIES, [])
        if not patterns:
            return text
        chars = None
        for pattern in patterns:
            for m in pattern.finditer(text):
                if chars is None:
                    chars = list(text)
                chars[m.start() : m.end()] = " " * (m.end() - m.start())
        return text if chars is None else "".join(chars)


def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise ConfigError(f"safety.{where}: invalid regular expression {pattern!r}: {exc}") from None


def _merge(base: Mapping[str, Sequence[str]], extra: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    merged = {c: list(ps) for c, ps in base.items()}
    for c, ps in extra.items():
        merged.setdefault(c, []).extend(ps)
    return merged
