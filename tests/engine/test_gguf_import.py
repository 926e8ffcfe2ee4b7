"""engine/gguf_import.py: a GGUF file, as llama.cpp's converter writes one, imported into a folder
the native engine serves: the same weights (F32) or close ones (Q8_0), the same tokenizer and chat
template, and the engine's greedy output equal to transformers' on the original checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import server
from engine.gguf_import import GGUFImportError, import_gguf
from engine.native.kernels import KernelMode
from engine.tokenizer import Tokenizer
from engine.types import GenerationRequest, SamplingParams
from test_greedy_equality import engine_for
from test_qwen3_5 import make_engine
from testing.tiny_gguf import write_gguf
from testing.tiny_model import QWEN3_5_TINY, build_tiny_family, build_tiny_llama

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there, how are you?"}]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-sources")
    built = {  # "llama": q/k rows permuted in the file; "qwen2": q/k/v biases; "qwen3": q/k norms
        "llama": build_tiny_llama(root / "llama", tie_word_embeddings=True, seed=31),
        "qwen2": build_tiny_llama(root / "qwen2", architecture="qwen2", tie_word_embeddings=False, seed=32),
        "qwen3": build_tiny_family(root / "qwen3", "qwen3", tokenizer=True, head_dim=32, seed=33),
        # Phi-3.5-mini's layout (fused projections, a sliding window, longrope) and Phi-4-mini's partial rope
        "phi3-longrope": build_tiny_family(
            root / "phi3-longrope",
            "phi3",
            tokenizer=True,
            sliding_window=40,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + i / 10 for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)],
            },
            seed=35,
        ),
        "phi3-partial": build_tiny_family(
            root / "phi3-partial", "phi3", tokenizer=True, partial_rotary_factor=0.5, seed=36
        ),
        # Qwen3.5: Gated DeltaNet layers, two key heads to four value heads (reordered in the file)
        "qwen3_5": build_tiny_family(root / "qwen3_5", "qwen3_5_text", tokenizer=True, seed=37, **QWEN3_5_TINY),
    }
    scalings = {  # the sources with a scaled rope, long prompts past their original context below
        "llama-llama3-rope": (
            "llama",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        "llama-linear": ("llama", {"rope_type": "linear", "factor": 2.0}),
    }
    for name, (base, rope) in scalings.items():
        built[name] = shutil.copytree(built[base], root / name)
        cfg = json.loads((built[name] / "config.json").read_text())
        cfg["rope_parameters"] = {**rope, "rope_theta": cfg["rope_parameters"]["rope_theta"]}
        (built[name] / "config.json").write_text(json.dumps(cfg))
    return built


def _greedy_transformers(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=10**9, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _greedy_engine(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    engine = engine_for(model_dir, num_blocks=16)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerationRequest("r", tuple(prompt), sampling))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "variant",
    ["llama", "qwen2", "qwen3", "llama-llama3-rope", "qwen2-yarn", "llama-linear", "phi3-longrope", "phi3-partial"],
)
def test_an_f32_gguf_becomes_the_same_model_tokenizer_and_template(sources, tmp_path, variant):
    """Rope scalings included, which llama.cpp's converter writes as metadata (linear, YaRN) or,
    for Llama 3's, as a tensor of per-frequency divisors, and transformers' reader drops."""
    src = sources[variant]
    done = import_gguf(write_gguf(src, tmp_path / "model.gguf"), tmp_path / "imported")
    out = tmp_path / "imported"
    arch = variant.split("-")[0]
    assert (done.out_dir, done.model_type, done.dtype) == (out, arch, "float32")
    rope = json.loads((src / "config.json").read_text()).get("rope_parameters") or {}
    imported_rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert {k: v for k, v in imported_rope.items() if k in rope} == {k: rope[k] for k in imported_rope if k in rope}
    assert imported_rope["rope_type"] == rope.get("rope_type", "default")
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    tied = {"lm_head.weight"} if variant.startswith("llama") else set()  # the llama sources tie their embeddings
    assert set(after) == set(before) - tied
    for name, tensor in after.items():  # llama.cpp's q/k row order undone exactly
        assert torch.equal(tensor, before[name]), name
    ours, theirs = Tokenizer.from_dir(out), Tokenizer.from_dir(src)
    assert ours.encode_chat(CHAT) == theirs.encode_chat(CHAT)  # the chat template and special tokens came along
    # the file names one EOS (<|im_end|>); the chat's other end token counts too, as in llama.cpp
    vocab = json.loads((src / "tokenizer.json").read_text())["added_tokens"]
    ends = {t["id"] for t in vocab if t["content"] in ("<|im_end|>", "<|endoftext|>")}
    assert set(ours.eos_token_ids) == set(theirs.eos_token_ids) | ends
    prompt = theirs.encode_chat(CHAT) * (1 if variant in ("llama", "qwen2", "qwen3", "phi3-partial") else 4)
    assert _greedy_engine(out, prompt, 12) == _greedy_transformers(src, prompt, 12)


def test_a_q8_0_gguf_imports_dequantized_in_bfloat16_close_to_the_original(sources, tmp_path):
    src = sources["qwen2"]
    done = import_gguf(write_gguf(src, tmp_path / "model-q8_0.gguf", quant="Q8_0"), tmp_path / "imported")
    assert done.dtype == "bfloat16"  # "auto" for a quantized file
    before, after = load_file(str(src / "model.safetensors")), load_file(str(done.out_dir / "model.safetensors"))
    assert all(tensor.dtype == torch.bfloat16 for tensor in after.values())
    for name, tensor in after.items():
        error = (tensor.float() - before[name]).norm() / before[name].norm()
        assert error < 0.01, (name, float(error))  # Q8_0's rounding and bfloat16's, not a wrong layout
    assert json.loads((done.out_dir / "gguf_import.json").read_text())["dtype"] == "bfloat16"
    prompt = Tokenizer.from_dir(src).encode_chat(CHAT)
    assert len(_greedy_engine(done.out_dir, prompt, 6)) == 6


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_qwen3_5_gguf_imports_as_the_release_with_llama_cpps_changes_undone(sources, tmp_path, quant):
    """transformers cannot read Qwen3.5 files (general.architecture qwen35): the import reads its
    metadata and undoes the converter's changes (norms as 1 + w, -exp(A_log), value heads tiled)."""
    src = sources["qwen3_5"]
    done = import_gguf(write_gguf(src, tmp_path / "model.gguf", quant=quant), tmp_path / "imported")
    assert (done.model_type, done.dtype) == ("qwen3_5_text", "float32" if quant == "F32" else "bfloat16")
    original, imported = (json.loads((d / "config.json").read_text()) for d in (src, done.out_dir))
    for key in ("layer_types", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim"):
        assert imported[key] == original[key], key
    assert imported["rope_parameters"]["partial_rotary_factor"] == original["rope_parameters"]["partial_rotary_factor"]
    before, after = load_file(str(src / "model.safetensors")), load_file(str(done.out_dir / "model.safetensors"))
    assert set(after) == set(before)
    for name, tensor in after.items():
        if quant == "F32":  # 1 + w and log(exp(.)) back, to float32's rounding
            torch.testing.assert_close(tensor, before[name], rtol=1e-6, atol=1e-6, msg=name)
        else:
            error = (tensor.float() - before[name]).norm() / before[name].norm()
            assert error < 0.01, (name, float(error))
    ours, theirs = Tokenizer.from_dir(done.out_dir), Tokenizer.from_dir(src)
    prompt = theirs.encode_chat(CHAT)
    assert ours.encode_chat(CHAT) == prompt
    engine = make_engine(done.out_dir, num_blocks=16, mode=KernelMode.TORCH)
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerationRequest("r", tuple(prompt), sampling))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    if quant == "F32":
        assert tokens == _greedy_transformers(src, prompt, 12)
    else:
        assert len(tokens) == 12


def test_what_cannot_be_imported_is_refused_naming_why_and_writes_nothing(sources, tmp_path):
    src = sources["qwen2"]
    not_gguf = tmp_path / "model.safetensors.gguf"
    shutil.copy(src / "model.safetensors", not_gguf)
    cases = [
        (not_gguf, "not a GGUF file"),
        (tmp_path / "missing.gguf", "no such file"),
        (write_gguf(src, tmp_path / "no-tokenizer.gguf", tokenizer=False), "cannot read its tokenizer"),
        (write_gguf(src, tmp_path / "gpt2.gguf", arch="gpt2"), "importing its architecture (gpt2) is not supported"),
    ]
    for path, message in cases:
        with pytest.raises(GGUFImportError, match=message.replace("(", r"\(").replace(")", r"\)")):
            import_gguf(path, tmp_path / "out")
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.importing").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="already exists and is not an empty folder"):
        import_gguf(write_gguf(src, tmp_path / "ok.gguf"), tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]


def test_the_import_gguf_command_writes_the_folder_and_says_how_to_serve_it(sources, tmp_path, capsys):
    blob = tmp_path / "sha256-0123abcd"  # an Ollama blob: GGUF without the suffix
    write_gguf(sources["llama"], blob)
    assert server.main(["import-gguf", str(blob), "--out", str(tmp_path / "m"), "--dtype", "float16"]) == 0
    said = capsys.readouterr().out
    assert f"wrote {tmp_path / 'm'} (llama," in said and "in float16" in said
    assert f"server.py --model {tmp_path / 'm'}" in said
    assert server.main(["import-gguf", str(blob), "--out", str(tmp_path / "m")]) == 1
    assert "cannot import:" in capsys.readouterr().err


def test_a_llama3_style_vocabulary_keeps_its_whole_words_as_the_original_does(sources, tmp_path):
    """tokenizer.ggml.pre "llama-bpe" (Llama 3's): the original looks each whole pre-token up before
    merging (ignore_merges), which transformers' reader leaves off; on llama.cpp's Llama 3 test set
    that made 1 of 46 strings differ (bench/gguf_tokenizers.py). Qwen2's merges as trained."""
    for pre, ignores in (("llama-bpe", True), ("qwen2", False)):
        out = tmp_path / pre
        import_gguf(write_gguf(sources["qwen2"], tmp_path / f"{pre}.gguf", tokenizer_pre=pre), out)
        model = json.loads((out / "tokenizer.json").read_text())["model"]
        assert bool(model.get("ignore_merges")) is ignores, pre


def test_a_sentencepiece_vocabulary_puts_its_prefix_before_a_leading_space_as_llama_cpp_does(tmp_path):
    """transformers rebuilds Llama 2's (and Mistral's) SentencePiece vocabulary with a Metaspace that
    adds no "▁" before a text that starts with a space; the original and llama.cpp add one (on
    llama.cpp's Llama 2 test set, 15 of 46 strings differed: bench/gguf_tokenizers.py)."""
    import gguf
    from gguf import GGUFReader
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, pre_tokenizers

    from engine.gguf_import import _as_llama_cpp_tokenizes

    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")  # the metadata alone
    writer.add_tokenizer_model("llama")
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    pieces = [("<unk>", 0.0), ("\u2581", -1.0), ("\u2581Hello", -1.0), ("Hello", -3.0)]
    pieces += [(c, -9.0) for c in "Helo"]
    rebuilt = Rust(models.Unigram(pieces, unk_id=0, byte_fallback=False))  # as transformers rebuilds it
    rebuilt.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    rebuilt.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    rebuilt.save(str(tmp_path / "tokenizer.json"))
    assert Rust.from_file(str(tmp_path / "tokenizer.json")).encode(" Hello").tokens == ["\u2581Hello"]
    _as_llama_cpp_tokenizes(GGUFReader(str(tmp_path / "spm.gguf")), tmp_path / "tokenizer.json")
    fixed = Rust.from_file(str(tmp_path / "tokenizer.json"))
    assert fixed.encode(" Hello").tokens == ["\u2581", "\u2581Hello"]  # llama.cpp's and Llama 2's own split
    assert fixed.encode("Hello").tokens == ["\u2581Hello"]


def test_a_llama_file_named_mistral_imports_as_llama_without_a_window(tmp_path):
    """transformers reads a 'llama' file named "mistral" as Mistral, for which gguf-py maps no tensor
    names (its reader then fails) and whose config class defaults to a 4,096-token window; llama.cpp
    runs the file as Llama over the whole context, and so is it imported."""
    src = build_tiny_llama(tmp_path / "mistral", seed=34)  # its folder's name is the file's general.name
    done = import_gguf(write_gguf(src, tmp_path / "mistral.gguf"), tmp_path / "imported")
    config = json.loads((done.out_dir / "config.json").read_text())
    assert (done.model_type, config.get("sliding_window")) == ("llama", None)
    prompt = Tokenizer.from_dir(src).encode_chat(CHAT)
    assert _greedy_engine(done.out_dir, prompt, 8) == _greedy_transformers(src, prompt, 8)
