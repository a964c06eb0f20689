"""Drafts that use the target's embedding (config.json ``ssdlib_embedding_from_target``): they
store only their layers and final norm, load beside the target as exactly the model with the
embedding copied in, refuse to load alone or beside a target of another width, materialise into
a standard HF directory, and keep SD (and SSD) exact."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ssdlib import Generator, SamplingParams
from ssdlib.capacity import weight_bytes
from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.loading import load_checkpoint
from ssdlib.loading.draft import load_draft, materialize_hf
from ssdlib.models.llama import LlamaForCausalLM
from tests.draft_helpers import checkpoint_logits
from tests.tiny import make_tiny_llama

EMBED = "model.embed_tokens.weight"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [40, 41]]
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


def make_shared_draft(target_dir: str, out: str, layers=(0,), noise: float = 0.02,
                      seed: int = 3, dtype=torch.float32, full: str | None = None) -> str:
    """A draft of target layers ``layers`` (+ noise) and the target's final norm, written without
    the embedding and with the flag; with ``full``, also the same draft as a plain HF dir (the
    target's embedding copied in, no flag)."""
    sd = load_file(os.path.join(target_dir, "model.safetensors"))
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    g = torch.Generator().manual_seed(seed)
    own = {"model.norm.weight": sd["model.norm.weight"]}
    for n, i in enumerate(layers):
        prefix = f"model.layers.{i}."
        for name, t in sd.items():
            if name.startswith(prefix):
                t = t + noise * torch.randn(t.shape, generator=g) if t.dim() > 1 else t
                own[f"model.layers.{n}." + name[len(prefix):]] = t
    own = {k: v.to(dtype).contiguous() for k, v in own.items()}
    cfg = dict(cfg, num_hidden_layers=len(layers), tie_word_embeddings=True)
    for directory, tensors, flag in ((out, own, True), (full, None, False)):
        if directory is None:
            continue
        if tensors is None:
            tensors = dict(own, **{EMBED: sd[EMBED].to(dtype)})
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, "model.safetensors"),
                  metadata={"format": "pt"})
        c = dict(cfg, ssdlib_embedding_from_target=True) if flag else cfg
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(c, f)
    return out


logits = checkpoint_logits


@pytest.fixture(scope="module")
def shared(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_embedding")
    target = tiny_dirs["smol_heads"]
    flagged = make_shared_draft(target, str(root / "flagged"), full=str(root / "full"))
    return target, flagged, str(root / "full")


def test_flagged_draft_is_the_draft_with_the_embedding_copied(shared):
    target, flagged, full = shared
    assert EMBED not in load_file(os.path.join(flagged, "model.safetensors"))
    target_ck = load_checkpoint(target)
    ck = load_draft(flagged, target_ck)
    assert ck.config.embedding_from_target and ck.config.num_hidden_layers == 1
    assert EMBED in ck.weights.names()
    assert ck.weights.shape(EMBED) == (90, 72)
    assert torch.equal(ck.weights.get(EMBED, dim=0, start=3, stop=7),
                       target_ck.weights.get(EMBED)[3:7])
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, ref = logits(ck, ids), logits(load_checkpoint(full), ids)
    assert torch.equal(ours, ref)
    # not trivially equal to the target: one layer of two, with noise
    assert not torch.allclose(ours, logits(target_ck, ids), atol=1e-3)


def test_flag_round_trips_through_the_config():
    d = {"vocab_size": 90, "hidden_size": 72, "intermediate_size": 96, "num_hidden_layers": 1,
         "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}
    assert not ModelConfig.from_hf_dict(d).embedding_from_target
    assert "ssdlib_embedding_from_target" not in ModelConfig.from_hf_dict(d).to_hf_dict()
    cfg = ModelConfig.from_hf_dict(dict(d, ssdlib_embedding_from_target=True))
    assert cfg.embedding_from_target
    assert cfg.to_hf_dict()["ssdlib_embedding_from_target"] is True
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # memory: at run time the draft holds a full (tied) embedding like any tied draft
    assert weight_bytes(cfg, 1, 2) == weight_bytes(ModelConfig.from_hf_dict(d), 1, 2)


def test_flagged_draft_alone_names_the_problem(shared):
    _, flagged, _ = shared
    ck = load_checkpoint(flagged)
    model = LlamaForCausalLM(ck.config, max_positions=64)
    with pytest.raises(CheckpointError, match="uses its target's embedding.*load_draft"):
        model.load_weights(ck.weights)


def test_flag_with_a_stored_embedding_is_refused(shared, tmp_path):
    _, _, full = shared
    d = str(tmp_path / "both")
    os.makedirs(d)
    os.link(os.path.join(full, "model.safetensors"), os.path.join(d, "model.safetensors"))
    with open(os.path.join(full, "config.json")) as f:
        cfg = dict(json.load(f), ssdlib_embedding_from_target=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="remove the tensor or the flag"):
        load_checkpoint(d)


def test_hidden_or_vocab_mismatch_is_refused(shared, tmp_path):
    _, flagged, _ = shared
    other = load_checkpoint(make_tiny_llama(str(tmp_path / "wide"), "smol_heads",
                                            hidden_size=90, intermediate_size=96))
    assert other.config.vocab_size == 90
    with pytest.raises(CheckpointError, match="hidden_size is 72 and the target .* has 90"):
        load_draft(flagged, other)
    big_vocab = load_checkpoint(make_tiny_llama(str(tmp_path / "vocab"), "smol_heads",
                                                vocab_size=96))
    with pytest.raises(CheckpointError, match="vocab"):
        load_draft(flagged, big_vocab)


def test_gguf_target_serves_its_dequantised_embedding(tiny_gguf, tmp_path):
    from ssdlib.loading.gguf_file import load_gguf

    g = tiny_gguf(tied=True)
    target_ck = load_gguf(g.path)
    c = target_ck.config
    out = str(tmp_path / "draft")
    os.makedirs(out)
    cfg = dict(c.to_hf_dict(), num_hidden_layers=1, tie_word_embeddings=True,
               ssdlib_embedding_from_target=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    own = {n: torch.from_numpy(v).contiguous() for n, v in g.weights.items()
           if n.startswith("model.layers.0.") or n == "model.norm.weight"}
    save_file(own, os.path.join(out, "model.safetensors"))
    ck = load_draft(out, target_ck)
    emb = torch.from_numpy(g.weights[EMBED])
    assert torch.equal(ck.weights.get(EMBED), emb)
    model = LlamaForCausalLM(ck.config, max_positions=32)
    model.load_weights(ck.weights)
    assert torch.equal(model.model.embed_tokens.weight, emb)


def test_materialize_hf_loads_as_a_plain_checkpoint_with_equal_logits(shared, tmp_path):
    target, flagged, full = shared
    target_ck = load_checkpoint(target)
    out = materialize_hf(flagged, target_ck, str(tmp_path / "hf"))
    with open(os.path.join(out, "config.json")) as f:
        assert "ssdlib_embedding_from_target" not in json.load(f)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(tensors[EMBED], target_ck.weights.get(EMBED))
    ck = load_checkpoint(out)
    assert not ck.config.embedding_from_target
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(ck, ids), logits(load_checkpoint(full), ids))
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, logits(ck, ids), atol=1e-5)


@pytest.fixture(scope="module")
def ar_reference(tiny_dirs):
    with Generator(target=tiny_dirs["smol_heads"], max_batch=4, max_len=128) as g:
        return [o.token_ids for o in g.generate(PROMPTS, GREEDY)]


def test_sd_with_a_flagged_draft_equals_ar(shared, ar_reference):
    target, flagged, _ = shared
    with Generator(target=target, draft=flagged, mode="sd", k=4, max_batch=2,
                   max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_reference
    # the draft is a noisy copy of half the target: it is accepted often, not always
    rates = [o.metrics["acceptance_rate"] for o in outs]
    assert 0 < sum(rates) / len(rates) < 1


@pytest.mark.parametrize("mode,placement", [("ssd", "leader"), ("sd", "separate")])
def test_speculator_rank_with_a_flagged_draft_equals_ar(shared, ar_reference, mode, placement):
    """The speculator (its own rank, or the draft's rank of SD) loads the draft beside the
    target: loaded alone, a flagged draft has no embedding and the rank would fail."""
    target, flagged, _ = shared
    with Generator(target=target, draft=flagged, mode=mode, draft_placement=placement, k=4,
                   max_batch=2, max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_reference


def test_bench_hf_assisted_peer_uses_the_materialised_draft(shared, tmp_path):
    transformers = pytest.importorskip("transformers")
    target, flagged, _ = shared
    try:
        transformers.AutoModelForCausalLM.from_pretrained(target)
    except Exception as e:  # noqa: BLE001 - any failure to load means: no peers here
        pytest.skip(f"transformers cannot load the tiny checkpoint: {e}")
    from tools.bench import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "bench.json"
    assert main(["--target", target, "--draft", flagged, "--prompts-file", str(prompts),
                 "--n-prompts", "2", "--max-new-tokens", "8", "--max-len", "128",
                 "--modes", "ar", "--peers", "hf", "--passes", "1", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["hf-assisted"]["tokens"] == 16
    assert rows["hf-assisted"]["greedy_equals_ar"] is True


def test_one_gguf_file_gives_one_tokenizer_until_it_changes(tiny_gguf):
    """Loading a GGUF twice (the target, then the draft naming it) builds its tokenizer once;
    a rewritten file gets a fresh one."""
    from ssdlib.loading.gguf_file import load_gguf

    g = tiny_gguf()
    first, again = load_gguf(g.path).tokenizer, load_gguf(g.path).tokenizer
    assert first is not None and first is again
    st = os.stat(g.path)
    os.utime(g.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load_gguf(g.path).tokenizer is not first
