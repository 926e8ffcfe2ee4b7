"""Grammar-constrained decoding with llguidance: schema checks, per-request matchers, token masks.

Owns the translation of a `StructuredOutput` into an llguidance grammar (checked once per spec,
naming any unsupported schema feature), one compiled matcher per spec per tokenizer (cached;
each request gets a copy), and the token bitmask that the sampler applies to a row's logits.
It never samples and never touches a model; rows without a grammar never reach this code.
"""

from __future__ import annotations

import collections
import functools
import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import structlog
import tokenizers
import torch

from engine.types import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = structlog.get_logger(__name__)

# Compact JSON: a model under a grammar that allows free whitespace can pad forever.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# Compiled matchers kept for reuse (a client sending the same tools or schema every request);
# a wide schema's matcher holds megabytes, so few.
_MATCHER_CACHE_ENTRIES = 32
# What one schema may hold, checked before llguidance sees it: a schema is the caller's input,
# and llguidance overflows its stack on a $ref chain of a few thousand (the whole process dies),
# compiles for long on wide ones and keeps what it compiled. Real schemas (OpenAI's own limits:
# 10 levels of nesting, 5,000 properties) stay far below these.
MAX_SCHEMA_CHARS = 100_000  # of its JSON text
MAX_SCHEMA_NODES = 5_000  # objects in it (subschemas and property maps)
MAX_SCHEMA_DEPTH = 64  # objects inside objects on the deepest path, a $ref followed as a step down
# Arrays and objects inside each other anywhere in a schema, its data (enum, const) too: what the
# recursive walks before compiling (a copy, closing objects, JSON text) can take. MAX_SCHEMA_DEPTH
# levels of schema hold at most about three each (an object, its properties map, an anyOf array).
MAX_JSON_DEPTH = 256
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values are data, not schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class GrammarError(ValueError):
    """The grammar or schema cannot be compiled; the message names the problem (a 400)."""


@functools.lru_cache(maxsize=256)
def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar for `structured`, validated; raises GrammarError naming the problem."""
    if structured.kind is StructuredKind.LARK:
        grammar = llguidance.LLMatcher.grammar_from_lark(structured.spec)
    else:
        schema = '{"type": "object"}' if structured.kind is StructuredKind.JSON_OBJECT else structured.spec
        if structured.kind is StructuredKind.JSON_SCHEMA:
            check_schema_size(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the schema is not a JSON object: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(_explain(messages[0] if messages else "invalid grammar"))
    _check_satisfiable(grammar, "text" if structured.kind is StructuredKind.LARK else "JSON value")
    if structured.kind is StructuredKind.JSON_SCHEMA and not has_finite_instance(json.loads(structured.spec)):
        raise GrammarError(
            "the schema cannot be compiled: no finite JSON value satisfies it (each value must contain another)"
        )
    return grammar


def check_json_depth(value: object) -> None:
    """GrammarError when `value` nests arrays and objects more than MAX_JSON_DEPTH deep.
    Iterative: what it refuses would exhaust the stack of the recursive walks that follow."""
    todo: list[tuple[object, int]] = [(value, 1)]
    while todo:
        node, level = todo.pop()
        if level > MAX_JSON_DEPTH:
            raise GrammarError(f"the schema nests too deeply: more than {MAX_JSON_DEPTH} arrays and objects")
        items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        todo.extend((item, level + 1) for item in items if isinstance(item, (dict, list)))


def check_schema_size(text: str) -> None:
    """GrammarError unless the schema (JSON text) is within MAX_SCHEMA_CHARS, MAX_SCHEMA_NODES and
    MAX_SCHEMA_DEPTH. Iterative: a deep schema must not exhaust this stack either."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"the schema is too large: {len(text)} characters, at most {MAX_SCHEMA_CHARS}")
    try:
        root = json.loads(text)
    except (ValueError, RecursionError):
        raise GrammarError("the schema is not valid JSON, or nests too deeply") from None
    children = _schema_graph(root)
    depth: dict[int, int] = {}  # object id -> objects on its deepest path down (cycles cut)
    best: dict[int, int] = {}  # object id -> the deepest of its children finished so far
    if not isinstance(root, dict):
        return
    path = [(root, iter(children[id(root)]))]
    on_path = {id(root)}
    while path:
        node, kids = path[-1]
        child = next(kids, None)
        if child is None:
            path.pop()
            on_path.discard(id(node))
            depth[id(node)] = level = 1 + best.get(id(node), 0)
            if level > MAX_SCHEMA_DEPTH:
                raise GrammarError(
                    f"the schema nests too deeply: {level} levels (a $ref counted as one), at most {MAX_SCHEMA_DEPTH}"
                )
            if path:
                parent = id(path[-1][0])
                best[parent] = max(best.get(parent, 0), level)
        elif id(child) in depth:
            best[id(node)] = max(best.get(id(node), 0), depth[id(child)])
        elif id(child) not in on_path:  # on the path: a recursive schema, its loop is not a level
            path.append((child, iter(children[id(child)])))
            on_path.add(id(child))


def _schema_graph(root: object) -> dict[int, list[dict]]:
    """Each object in the schema -> the objects directly inside it and, for a local `$ref`, its
    target; GrammarError past MAX_SCHEMA_NODES objects."""
    children: dict[int, list[dict]] = {}
    name_maps: set[int] = set()  # `properties`, `$defs`, ...: every value is a schema, whatever its name
    todo = [root]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict) or id(node) in children:
            continue
        if len(children) >= MAX_SCHEMA_NODES:
            raise GrammarError(f"the schema is too large: more than {MAX_SCHEMA_NODES} objects in it")
        inner: list[dict] = []
        is_map = id(node) in name_maps
        name_maps.update(id(v) for k, v in node.items() if not is_map and k in _NAMED_SCHEMAS and isinstance(v, dict))
        values = [v for k, v in node.items() if is_map or k not in _DATA_KEYWORDS]
        while values:  # through arrays (anyOf, prefixItems, ...) to the objects in them
            value = values.pop()
            if isinstance(value, dict):
                inner.append(value)
            elif isinstance(value, list):
                values.extend(value)
        ref = node.get("$ref")
        target = _pointer(root, ref) if isinstance(ref, str) and ref.startswith("#") else None
        if isinstance(target, dict):
            inner.append(target)
        children[id(node)] = inner
        todo.extend(inner)
    return children


def _pointer(root: object, ref: str) -> object:
    """The value a local JSON pointer (`#/$defs/a`) names in `root`; None where it names nothing."""
    node: object = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdecimal() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def has_finite_instance(schema: object) -> bool:
    """False when no finite JSON value can satisfy `schema` because each one must contain another
    (`{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}`): llguidance compiles such a schema
    and the answer stops mid-value. A least fixed point over the local `$ref` targets, by worklist
    (a reference is looked at again only when one it depends on turned out finite: linear in the
    schema, however long its chains of references); it says False only when sure (required
    properties, non-empty arrays, anyOf/oneOf, allOf). Recursive over the schema's own nesting,
    which check_schema_size bounds."""
    known: dict[str, bool] = {}  # "#/..." -> whether a finite instance exists, as far as shown yet
    dependents: dict[str, set[str]] = {}  # ref -> the refs whose targets consulted it while it was False
    todo: collections.deque[str] = collections.deque()

    def finite(node: object, reader: str | None) -> bool:
        if not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref not in known:
                known[ref] = False
                todo.append(ref)
            if not known[ref]:
                if reader is not None:
                    dependents.setdefault(ref, set()).add(reader)
                return False
        for key, combine in (("anyOf", any), ("oneOf", any), ("allOf", all)):
            parts = node.get(key)
            if isinstance(parts, list) and parts and not combine(finite(p, reader) for p in parts):
                return False
        if "const" in node or "enum" in node:
            return True
        kinds = node.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds] if kinds is not None else None
        if kinds is not None and any(k not in ("object", "array") for k in kinds):
            return True  # a string, number, boolean or null will do
        listed, named = node.get("properties"), node.get("required")
        props: dict = listed if isinstance(listed, dict) else {}
        required: list = named if isinstance(named, list) else []
        if kinds == ["object"] and not all(finite(props[r], reader) for r in required if r in props):
            return False
        items, min_items = node.get("items"), node.get("minItems", 0)
        needs_items = kinds == ["array"] and isinstance(min_items, int) and min_items > 0
        return not needs_items or finite(items, reader)

    finite(schema, None)  # finds the references the schema starts from
    while todo:
        ref = todo.popleft()
        if known[ref]:
            continue
        target = _pointer(schema, ref)
        if target is None or finite(target, ref):  # a reference to nowhere: the compiler says so, not this check
            known[ref] = True
            todo.extend(dependents.pop(ref, ()))
    return finite(schema, None)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """One token per byte and an EOS: what a grammar allows does not depend on the vocabulary."""
    return llguidance.LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]  # missing from its stubs
        encoder={bytes([i]): i for i in range(256)}, special_tokens={"<eos>": 256}, pattern=r".", eos_token=256
    )


def _check_satisfiable(grammar: str, what: str) -> None:
    """GrammarError if the grammar allows no first byte. A schema that only refers to itself
    (`{"$ref": "#"}`) validates, but its matcher stops before any token: the answer would be an
    empty 200. One mask over a byte vocabulary finds it, before any model is involved."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    matcher.compute_bitmask()
    if matcher.is_error():
        raise GrammarError(f"the schema cannot be compiled: no {what} satisfies it (does it only refer to itself?)")


def _explain(message: str) -> str:
    if message.startswith("Unimplemented keys"):
        return f"the schema uses a feature this server does not support: {message}"
    return f"the schema cannot be compiled: {message}"


def schema_text(schema: dict) -> str:
    """Compact JSON text for a schema, its keys in the order given: the grammar writes an object's
    properties in the schema's order (a "reasoning" before its "answer" must stay first), and a
    tool's parameters reach the template as the client wrote them."""
    return json.dumps(schema, separators=(",", ":"))


def _without_deleting_normalizers(tokenizer_json: str) -> str:
    """The tokenizer for the grammar, without normalizer steps that delete text (a `Replace`
    with empty content, e.g. the demo models' quote-mark removal). llguidance tokenizes the
    bytes a grammar forces (`":` after a JSON key) with the tokenizer's own pipeline; a step
    that deletes the `"` there makes the forced tokens disagree with the grammar, and the answer
    stops mid-JSON. Output bytes come from the vocabulary, never from a normalizer, so steps
    that only delete input text do not belong here. Other steps (NFC, SentencePiece's space
    marks) stay: they shape how text maps to tokens."""
    data = json.loads(tokenizer_json)
    norm = data.get("normalizer")

    def deletes(step: dict) -> bool:
        return step.get("type") == "Replace" and step.get("content") == ""

    if not isinstance(norm, dict):
        return tokenizer_json
    if deletes(norm):
        data["normalizer"] = None
    elif norm.get("type") == "Sequence" and any(deletes(s) for s in norm.get("normalizers", [])):
        kept = [s for s in norm["normalizers"] if not deletes(s)]
        data["normalizer"] = {"type": "Sequence", "normalizers": kept} if kept else None
    else:
        return tokenizer_json
    return json.dumps(data)


class GrammarCompiler:
    """Matchers for one tokenizer; compiled once per spec, copied per request."""

    def __init__(self, tokenizer_file: Path, *, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._tokenizer_file = tokenizer_file
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s for 150k tokens)
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            text = _without_deleting_normalizers(self._tokenizer_file.read_text(encoding="utf-8"))
            # A tokenizer may hold more tokens than the model has logits (tokens added by a fine-tune
            # without resizing the embeddings): masks cover both, and only the logits' part is applied.
            num_tokens = tokenizers.Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
            self.vocab_size = max(self.vocab_size, num_tokens)
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos_token_ids)
        return self._tokenizer

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar; raises GrammarError if it cannot compile."""
        proto = self._compiled.get(structured)
        if proto is None:
            proto = llguidance.LLMatcher(self._llg_tokenizer(), grammar_text(structured), log_level=0)
            if proto.is_error():
                raise GrammarError(_explain(proto.get_error()))
            self._compiled[structured] = proto
            if len(self._compiled) > _MATCHER_CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured)
        return GrammarMatcher(proto.deep_copy(), self.vocab_size)


# One thread computes every matcher's next-token mask while the step's forward runs (llguidance
# releases the GIL while it computes), so the step does not wait for masks after the forward.
_MASK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_matcher", "_pending", "_words")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)
        self._pending: Future[None] | None = None  # the mask for the current position, being computed

    def prefetch_mask(self) -> None:
        """Start computing the mask for the current position on the mask thread (called before
        the forward); `fill_bitmask` then only waits for it. Idempotent until the next accept."""
        if self._pending is None:
            self._pending = _MASK_THREAD.submit(self._compute, self._words)

    def _compute(self, words: np.ndarray) -> None:
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32 words, bit i of word j: token 32j+i)."""
        if self._pending is None:
            self._compute(self._words)  # the matcher's own width: it may exceed the logits' (`row`)
        else:
            self._pending.result()  # raises what the computation raised
        row[:] = self._words[: row.shape[0]]

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar did not allow it (then it is stuck)."""
        if self._pending is not None:
            self._pending.result()  # never move the matcher while its mask is being computed
            self._pending = None
        if self._matcher.is_stopped():
            return True  # the EOS after a complete answer
        ok = self._matcher.consume_token(token_id)
        if not ok:
            # llguidance's error can quote the whole grammar (a schema of the caller's): its head is enough.
            log.warning("grammar_rejected_token", token_id=token_id, error=self._matcher.get_error()[:300])
        return ok

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence should stop)."""
        return self._matcher.is_stopped()


def apply_bitmasks(logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
    """Set to -inf every token the matchers disallow, in place; logits: [num_rows, vocab]."""
    vocab = logits.shape[1]
    words = np.full((len(rows), (vocab + 31) // 32), -1, dtype=np.int32)  # [num_constrained, vocab / 32]
    for i, matcher in enumerate(matchers):
        matcher.fill_bitmask(words[i])
    disallowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        array = logits.numpy()  # numpy keeps the GIL: no hand-over to the event loop mid-step
        for i, row in enumerate(rows):
            np.putmask(array[row], disallowed[i], -np.inf)
        return
    mask = torch.from_numpy(disallowed).to(logits.device)
    for i, row in enumerate(rows):  # in-place on row views (a tensor-indexed assignment is ~1000x slower on CPU)
        logits[row].masked_fill_(mask[i], float("-inf"))
