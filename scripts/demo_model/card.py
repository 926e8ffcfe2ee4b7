"""Writes each demo model's card (models/<name>/README.md) and loss-curve PNG from the training
logs in the build directory, after scoring both saved models on the held-out split (with
transformers) and asking the real server for sample conversations: `server.py` runs as a
subprocess with the default config.toml and answers POST /v1/chat/completions, so the card
shows what users get. Reads models, never changes their weights.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: write PNG files, never open a window
import matplotlib.pyplot as plt

from scripts.demo_model import licences, sources
from scripts.demo_model.dataset import (
    NUM_FREQUENT_WORDS,
    RARE_FROM_RANK,
    UNFAMILIAR_FROM_RANK,
    Conversation,
    read_jsonl,
    unknown_words,
)
from scripts.demo_model.evaluate import (
    NUM_GREETED_WORDS,
    QUOTED_PROBES,
    GreetedProbe,
    GreetedScore,
    WordScore,
    greeted_probes,
    greeted_score,
    heldout_loss,
    known_word_score,
    load_for_eval,
    perplexity,
    read_known_words,
    scored_sample,
)
from scripts.demo_model.sources import Sense
from scripts.demo_model.tokenizer import encode_conversation
from scripts.demo_model.train import CHECKPOINT_EVERY, SPECS
from testing.server_proc import ServerProcess

# The web UI's empty chat shows these (the card's "Try:" line): prompts both models answer
# well at temperature 0 (see the samples below).
EXAMPLE_PROMPTS = ("Hello!", "What does water mean?", "Tell me a fortune.")
SAMPLE_PROMPTS = (
    "Hello!",
    "Who are you?",
    "What does water mean?",
    "What does happy mean?",
    "What does music mean?",
    "What does {heldout} mean?",
    "Define {heldout2}.",
    "Use garden in a sentence.",
    "What is another word for big?",
    "Tell me a fortune.",
    "What is the capital of France?",
)
# Multi-turn chats: each user turn is sent with the earlier turns and the server's own
# (greedy) replies in `messages`, as the web UI does.
SAMPLE_CHATS = (
    ("Hello!", "What does {heldout} mean?", "Thank you!"),
    ("Who are you?", "What does garden mean?", "Use it in a sentence."),
)
MAX_TOKENS = 96
# The card's sampled measures: at the model's defaults (generation_config.json, what a request
# that sets no temperature gets) and at OpenAI's default, temperature 1 with top-p 1.
OPENAI_DEFAULT_SAMPLING = {"temperature": 1.0, "top_p": 1.0}
NUM_SAMPLED_WORDS = 100  # a seeded sample of the known words, asked with sampled replies
SAMPLING_SEED = 1000
_SMOOTH_STEPS = 25
_REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Reply:
    text: str
    finish_reason: str  # as the server returned it: stop, length, content_filter


@dataclass(frozen=True, slots=True)
class PromptSample:
    prompt: str
    greedy: Reply
    sampled: Reply
    seed: int


@dataclass(frozen=True, slots=True)
class ServerSamples:
    prompts: tuple[PromptSample, ...]  # single user turn, greedy and sampled
    chats: tuple[tuple[tuple[str, Reply], ...], ...]  # multi-turn, greedy: (user text, reply) per turn
    server_settings: str  # how server.py was configured, for the card


@dataclass(frozen=True, slots=True)
class SampledScores:
    label: str  # how the replies were drawn, for the card
    known: WordScore
    greeted: GreetedScore


@dataclass(frozen=True, slots=True)
class ModelReport:
    name: str
    perplexity_heldout: float  # all held-out conversations (build/.../heldout.jsonl)
    perplexity_repo_sample: float  # the committed models/heldout.jsonl sample
    num_parameters: int
    weights_bytes: int
    samples: ServerSamples
    greeted: GreetedScore | None = None  # first messages that open with a greeting
    quoted: WordScore | None = None  # known words asked about in quotes ('What does "water" mean?')
    sampled: tuple[SampledScores, ...] = ()  # the same measures with sampled replies


def write_cards(out: Path, build_dir: Path, heldout: list[Conversation]) -> None:
    repo_sample = read_jsonl(out / "heldout.jsonl")
    words = unknown_words(repo_sample)
    prompts = [p.format(heldout=words[0], heldout2=words[1]) for p in SAMPLE_PROMPTS]
    chats = [[p.format(heldout=words[0]) for p in chat] for chat in SAMPLE_CHATS]
    names = [name for name in SPECS if (out / name).is_dir()]
    samples = server_samples(names, prompts, chats)
    known_words = read_known_words(build_dir / "data" / "known_words.jsonl")
    probes = greeted_probes(known_words)
    words = scored_sample(known_words, SAMPLING_SEED)[:NUM_SAMPLED_WORDS]
    reports = [_report(out / name, heldout, repo_sample, samples[name], probes, words) for name in names]
    data_stats = _read_json(build_dir / "data" / "stats.json")
    summaries = {r.name: _read_json(build_dir / r.name / "summary.json") | {"data": data_stats} for r in reports}
    for report in reports:
        run_dir = build_dir / report.name
        summary = summaries[report.name]
        rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
        plot_loss_curve(rows, report.name, out / report.name / "loss_curve.png")
        text = render_card(report, reports, summary, (len(heldout), len(repo_sample)), summaries)
        (out / report.name / "README.md").write_text(text, encoding="utf-8")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def server_samples(
    names: list[str], prompts: list[str], chats: list[list[str]], server_args: tuple[str, ...] = ()
) -> dict[str, ServerSamples]:
    """Start `server.py` (default config.toml, then server_args) and ask it, per model, every
    prompt greedily and sampled, and every multi-turn chat greedily."""
    settings = describe_server_settings(server_args)
    with tempfile.TemporaryDirectory(prefix="demo-card-") as tmp:
        log_path = Path(tmp) / "server.log"
        proc = ServerProcess(["--db", str(Path(tmp) / "chat.db"), *server_args], log_path=log_path)
        try:
            proc.start(timeout_s=600.0)  # two models and the safety embedder on a busy CPU
            return {name: _ask_server(proc.base_url, name, prompts, chats, settings) for name in names}
        except Exception:
            print(f"server log (end):\n{log_path.read_text(errors='replace')[-4000:]}")
            raise
        finally:
            if proc.proc is not None and proc.proc.poll() is None:
                try:
                    proc.terminate()  # SIGTERM; kills after 30 s
                except subprocess.TimeoutExpired:
                    pass


def describe_server_settings(server_args: tuple[str, ...] = ()) -> str:
    """The settings the samples were produced with, for the card."""
    import torch

    device = "CUDA, bfloat16" if torch.cuda.is_available() else "CPU, float32"
    extra = "".join(f" `{arg}`" for arg in server_args if arg != "--set")
    overrides = f" plus{extra}" if extra else ""
    safety = "off" if "safety.enabled=false" in server_args else "on, as shipped"
    return (
        f"its default `config.toml`{overrides} (native engine, `engine.device` "
        f"and `dtype` auto: {device} on the machine that wrote this card; safety screening "
        f"{safety})"
    )


def _ask_server(base_url: str, name: str, prompts: list[str], chats: list[list[str]], settings: str) -> ServerSamples:
    singles = []
    for seed, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}]
        greedy = chat_completion(base_url, name, messages, temperature=0.0)
        sampled = chat_completion(base_url, name, messages, seed=seed)  # the model's default sampling
        singles.append(PromptSample(prompt, greedy, sampled, seed))
    conversations = []
    for chat in chats:
        messages: list[dict] = []
        turns = []
        for user_text in chat:
            messages.append({"role": "user", "content": user_text})
            reply = chat_completion(base_url, name, messages, temperature=0.0)
            messages.append({"role": "assistant", "content": reply.text})
            turns.append((user_text, reply))
        conversations.append(tuple(turns))
    return ServerSamples(tuple(singles), tuple(conversations), settings)


def chat_completion(base_url: str, model: str, messages: list[dict], **params) -> Reply:
    """One non-streaming POST /v1/chat/completions; params: temperature, top_p, seed."""
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, **params}
    request = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S) as response:
        answer = json.loads(response.read())
    if answer["model"] != model:  # a fallback to another model would mislabel the sample
        raise RuntimeError(f"asked {model}, answered by {answer['model']}")
    choice = answer["choices"][0]
    return Reply(choice["message"]["content"].strip(), choice["finish_reason"])


def _report(
    model_dir: Path,
    heldout: list[Conversation],
    repo_sample: list[Conversation],
    samples: ServerSamples,
    probes: list[GreetedProbe],
    words: list[Sense],
) -> ModelReport:
    model, hf_tokenizer = load_for_eval(model_dir)
    tokenizer = hf_tokenizer.backend_tokenizer  # the raw `tokenizers` object, as in training
    full = heldout_loss(model, [encode_conversation(tokenizer, c) for c in heldout])
    sample = heldout_loss(model, [encode_conversation(tokenizer, c) for c in repo_sample])
    return ModelReport(
        model_dir.name,
        perplexity(full),
        perplexity(sample),
        sum(p.numel() for p in model.parameters()),
        (model_dir / "model.safetensors").stat().st_size,
        samples,
        greeted_score(model, hf_tokenizer, probes),
        known_word_score(model, hf_tokenizer, words, questions=QUOTED_PROBES),
        tuple(
            SampledScores(
                label,
                known_word_score(model, hf_tokenizer, words, SAMPLING_SEED, sampling),
                greeted_score(model, hf_tokenizer, probes, SAMPLING_SEED, sampling),
            )
            for label, sampling in _sampling_settings(model_dir)
        ),
    )


def _sampling_settings(model_dir: Path) -> list[tuple[str, dict | None]]:
    """(label, sample_reply's sampling) for the model's defaults and OpenAI's."""
    config = _read_json(model_dir / "generation_config.json")
    defaults = ", ".join(f"{k.replace('_', '-')} {config[k]}" for k in ("temperature", "top_p") if k in config)
    return [
        (f"the model's default ({defaults or 'none set: temperature 1'})", None),
        ("OpenAI's default (temperature 1, top-p 1)", OPENAI_DEFAULT_SAMPLING),
    ]


def plot_loss_curve(rows: list[dict], name: str, path: Path) -> None:
    steps = [r["step"] for r in rows if "train_loss" in r]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    windows = [losses[max(0, i - _SMOOTH_STEPS + 1) : i + 1] for i in range(len(losses))]
    smoothed = [sum(w) / len(w) for w in windows]
    eval_rows = [r for r in rows if "heldout_loss" in r]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(steps, losses, color="#9ecae1", linewidth=0.6, label="train (per step)")
    axes.plot(steps, smoothed, color="#08519c", linewidth=1.5, label=f"train ({_SMOOTH_STEPS}-step mean)")
    axes.plot(
        [r["step"] for r in eval_rows], [r["heldout_loss"] for r in eval_rows], "o-", color="#e6550d", label="held-out"
    )
    axes.set(xlabel="step", ylabel="loss (nats per assistant token)", title=f"{name}: training loss")
    axes.set_ylim(0, max(losses) * 1.05)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _package_versions() -> str:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Version}, ", *sources.APT_PACKAGES],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip().rstrip(",") or "(dpkg-query unavailable)"


def render_card(
    report: ModelReport,
    all_reports: list[ModelReport],
    summary: dict,
    heldout_sizes: tuple[int, int],
    summaries: dict[str, dict],
) -> str:
    """heldout_sizes: (conversations in the full held-out split, in models/heldout.jsonl);
    summaries: every model's summary.json by name (summary is this model's)."""
    lines = [
        f"# {report.name}",
        "",
        f"**A small demo model, not an assistant to rely on.** {report.name} is a "
        f"{report.num_parameters / 1e6:.1f}M-parameter language model trained from scratch on one "
        "CPU core, so that this server answers in readable English with no download. "
        + _knows_sentence(summary["known_words"])
        + " It also tells fortune cookies and has some canned small talk; for a word it was not "
        "taught it should say it does not know it. It has no knowledge of the world, no "
        "arithmetic and no real memory of earlier turns, and what it says outside the above is "
        "made up.",
        "",
        "Try: " + ", ".join(f'"{prompt}"' for prompt in EXAMPLE_PROMPTS),
        "",
        *_architecture_section(report, summary["spec"]),
        *_evaluation_section(all_reports, heldout_sizes, summaries),
        *_training_section(summary),
        *_samples_section(report),
        *_data_section(summary["data"]),
    ]
    return "\n".join(lines) + "\n"


def _knows_sentence(known: dict) -> str:
    share = known["num_right"] / max(1, known["num_scored"])
    return (
        f"It knows the first WordNet sense of {known['num_known']:,} common English words (those "
        f"of the {NUM_FREQUENT_WORDS:,} most frequent that WordNet defines, function words aside): "
        f'asked "What does X mean?" at temperature 0, it answered {known["num_right"]} of a '
        f"sample of {known['num_scored']} of them with the first sense ({share:.1%}; an answer "
        "counts as right when it carries at least half of the sense's content words)."
    )


def _architecture_section(report: ModelReport, spec: dict) -> list[str]:
    return [
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        "| class | `LlamaForCausalLM` (Hugging Face layout, `config.json`) |",
        f"| parameters | {report.num_parameters:,} (input and output embeddings tied) |",
        f"| layers / hidden / MLP | {spec['num_hidden_layers']} / {spec['hidden_size']} / "
        f"{spec['intermediate_size']} |",
        f"| attention heads / KV heads | {spec['num_attention_heads']} / "
        f"{spec['num_key_value_heads']} (grouped-query) |",
        f"| context window | {spec['seq_len']} tokens (`max_position_embeddings`) |",
        "| vocabulary | 4,096 byte-level BPE tokens, shared by demo-mini and demo-flagship; quote marks "
        'around words are removed before encoding (`"friend"` reads as `friend`) |',
        f"| weights | `model.safetensors`, bfloat16, {report.weights_bytes / 1e6:.1f} MB |",
        "| chat format | ChatML-style template in `tokenizer_config.json`; `<|im_end|>` is EOS |",
        "",
    ]


def _evaluation_section(
    all_reports: list[ModelReport], heldout_sizes: tuple[int, int], summaries: dict[str, dict]
) -> list[str]:
    num_heldout, num_repo_sample = heldout_sizes
    rows = []
    for r in all_reports:
        k = summaries[r.name]["known_words"]
        share = k["num_right"] / max(1, k["num_scored"])
        greeted = f"{r.greeted.num_right}/{r.greeted.num_probes} ({r.greeted.share:.1%})" if r.greeted else "not run"
        quoted = f"{r.quoted.num_right}/{r.quoted.num_words}" if r.quoted else "not run"
        unfamiliar = summaries[r.name].get("unfamiliar_words", {})
        admitted = " | ".join(
            f"{u['num_right']}/{u['num_scored']}" if (u := unfamiliar.get(band)) else "not run"
            for band in ("less_common", "rare")
        )
        rows.append(
            f"| {r.name} | {r.num_parameters / 1e6:.1f}M | {k['num_right']}/{k['num_scored']} ({share:.1%}) "
            f"| {quoted} | {greeted} | {admitted} | {r.perplexity_heldout:.2f} | {r.perplexity_repo_sample:.2f} |"
        )
    return [
        "## Evaluation",
        "",
        "Known words: a seeded sample of the words the model was taught, each asked "
        '"What does X mean?" alone at temperature 0 (the saved bfloat16 weights, run in fp32 by '
        "`transformers`); an answer is right when it carries at least half of the content words "
        "of the word's first WordNet sense. Printed by `make demo-model`. In quotes: "
        f"{NUM_SAMPLED_WORDS} other known words asked the same way with the word in quotes, "
        + ", ".join(f"`{q}`" for q in QUOTED_PROBES)
        + " in turn (training asks about words without quotes; the tokenizer the model is served "
        "with removes quote marks around words before the model reads the text, "
        "`tokenizer.quote_normalizer`). Greeted first messages: "
        'questions that open with a greeting, as many first messages do ("Hi, who are you?", '
        '"Hello! What does water mean?"): every canned identity, help, how-are-you and thanks '
        f"question, {NUM_GREETED_WORDS} known words, a few off-topic questions and fortune requests, each after a "
        "seeded greeting (`scripts/demo_model/evaluate.py`), at temperature 0; a reply is right "
        "when it is the kind the question asks for (that group's canned reply, the word's first "
        "sense, a polite refusal, a fortune), and an example word it offers is one the models "
        "are taught to suggest (`smalltalk.EXAMPLE_WORDS`), not a made-up one. Words not taught: "
        '"What does X mean?" at temperature 0 for held-out words (never in training) of two bands, '
        f"less common words (frequency ranks {UNFAMILIAR_FROM_RANK:,} to {RARE_FROM_RANK:,}) and rarer "
        'ones; a reply is right when it is the trained "I don\'t know the word" (the model often '
        "garbles the word as it repeats it). Perplexity is over the "
        "assistant tokens of held-out conversations (unknown words, fortunes and phrasings never "
        f"seen in training): all {num_heldout} of the held-out split, and the {num_repo_sample} in "
        "`models/heldout.jsonl` that the tests use.",
        "",
        "| model | parameters | known words right | known words in quotes right | greeted first messages right "
        '| less common words: "I don\'t know" | rarer words: "I don\'t know" | held-out perplexity '
        "| `models/heldout.jsonl` perplexity |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *_sampling_section(all_reports),
    ]


def _sampling_section(all_reports: list[ModelReport]) -> list[str]:
    rows = [
        f"| {r.name} | {s.label} | {s.known.num_right}/{s.known.num_words} ({s.known.share:.0%}) "
        f"| {s.greeted.num_right}/{s.greeted.num_probes} ({s.greeted.share:.0%}) |"
        for r in all_reports
        for s in r.sampled
    ]
    if not rows:
        return []
    return [
        "### Sampling defaults",
        "",
        "A request that sets no `temperature` or `top_p` (the web UI sends none) gets the "
        "model's defaults from its `generation_config.json`, as in vLLM. These models set a "
        "lower temperature than OpenAI's default of 1, where they misspell words and blend "
        "replies. The same measures as above with sampled replies (seeded, top-k off, as the "
        f"server samples), with {NUM_SAMPLED_WORDS} known words of another seeded sample:",
        "",
        "| model | sampling | known words right | greeted first messages right |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def _training_section(summary: dict) -> list[str]:
    spec = summary["spec"]
    minutes = summary["wall_time_s"] / 60
    return [
        "## Training",
        "",
        f"Rebuilt by `python -m scripts.demo_model.build --out models` (`make demo-model`), seed "
        f"1234, `torch.set_num_threads(1)`: {spec['max_steps']} AdamW steps (betas 0.9/0.95, "
        f"weight decay 0.1, clip 1.0), peak learning rate {spec['learning_rate']}, "
        f"{spec['warmup_steps']} warmup steps then cosine decay to a tenth at step "
        f"{spec['decay_steps']} (the rate depends on the step alone, so a longer run resumes from "
        f"the checkpoint written every {CHECKPOINT_EVERY} steps with the same result); batches of "
        f"{spec['batch_size']} rows of {spec['seq_len']} tokens packed with whole "
        f"conversations ({summary['num_tokens_seen'] / 1e6:.1f}M token positions); the loss "
        "covers assistant replies and their `<|im_end|>` only (about 60% of the positions). fp32 "
        "master weights with bfloat16 autocast on a CPU that has bfloat16 support (fp32 on one "
        "that does not), saved as bfloat16. The same command gives the same weights bit for bit "
        f"on the same kind of CPU (this build: {summary.get('cpu', 'unknown CPU')}); another "
        "kind of CPU gives other weights of the same quality. Wall time "
        f"{minutes:.0f} minutes on a 2-core machine shared with other work (one process and one "
        "thread per model, demo-mini and demo-flagship side by side).",
        "",
        "![loss curve](loss_curve.png)",
        "",
    ]


def _samples_section(report: ModelReport) -> list[str]:
    name = report.name
    lines = [
        "## Sample conversations",
        "",
        "Produced by the server in this repository: `server.py` started with "
        f"{report.samples.server_settings} and a fresh temporary database, serving demo-flagship "
        "and demo-mini; each reply is the answer "
        f'to a non-streaming `POST /v1/chat/completions` with `"model": "{name}"` and '
        f'`"max_tokens": {MAX_TOKENS}`, which the native engine generated from the prompt '
        "rendered with this model's chat template (`tokenizer_config.json`). Each prompt was sent "
        'twice: greedy (`"temperature": 0`) and sampled (no `temperature` or `top_p`: the '
        'model\'s defaults, see "Sampling defaults" above; the `"seed"` shown, so the same '
        "request gives the same reply). Rebuilt by `python -m scripts.demo_model.build "
        "--cards-only`.",
        "",
        "### Single questions",
        "",
    ]
    for sample in report.samples.prompts:
        lines += [
            f"> **user:** {sample.prompt}",
            ">",
            f"> **{name} (greedy):** {_reply(sample.greedy)}",
            ">",
            f"> **{name} (sampled, seed {sample.seed}):** {_reply(sample.sampled)}",
            "",
        ]
    lines += [
        "### Multi-turn chats",
        "",
        "Greedy; every request carries the whole chat so far in `messages`, the model's earlier replies included.",
        "",
    ]
    for chat in report.samples.chats:
        for index, (user_text, reply) in enumerate(chat):
            lines += [*([">"] if index else []), f"> **user:** {user_text}", ">", f"> **{name}:** {_reply(reply)}"]
        lines.append("")
    return lines


def _reply(reply: Reply) -> str:
    notes = {"stop": "", "length": f" *(cut off at {MAX_TOKENS} tokens)*"}
    note = notes.get(reply.finish_reason, f" *(finish_reason: {reply.finish_reason})*")
    return _quote(reply.text) + note


def _quote(text: str) -> str:
    return text.replace("\n", "\\\n> ")  # a hard line break inside the quote


def _data_section(stats: dict) -> list[str]:
    return [
        "## Training data and licences",
        "",
        "Built by `scripts/demo_model/dataset.py` from Debian packages installed with apt "
        f"({_package_versions()}) and the English word list of the `wordfreq` package: for "
        f"{stats['num_words']:,} known words (of wordfreq's {NUM_FREQUENT_WORDS:,} most frequent, "
        "those WordNet defines, function words aside), the first WordNet 3.0 sense, asked three "
        'ways ("What does X mean?" and two other phrasings) and answered with the definition, plus '
        'some "use X in a sentence" (WordNet\'s example) and "another word for X" turns; rare '
        'WordNet words answered with "I don\'t know the word X"; '
        f'{stats["num_fortunes"]:,} short fortunes as answers to "Tell me a fortune."; and '
        "greeting, identity, help and refusal turns. 15% of conversations are chained into "
        "2-3 turn chats, 10% carry a system prompt. 3% of the rare words, fortunes and phrasings "
        "(chosen by a hash) are held out; no known word is.",
        "",
        "### WordNet",
        "",
        licences.WORDNET_LICENCE,
        "",
        "### fortunes",
        "",
        licences.FORTUNES_NOTICE.format(files=", ".join(sources.FORTUNE_FILES)),
        "",
        "### Project text",
        "",
        licences.OWN_TEXT_NOTICE,
    ]
