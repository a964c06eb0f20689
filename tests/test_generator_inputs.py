"""Generator inputs: one prompt given alone is one prompt; a configuration
whose KV cache cannot fit is refused before anything is allocated, saying what fits."""

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.errors import ConfigError
from tests.tiny_chat import make_tiny_chat_model

P = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    d = make_tiny_chat_model(str(tmp_path_factory.mktemp("chat") / "m"))
    with Generator(target=d, max_len=64) as g:
        yield g


def test_a_single_prompt_is_one_prompt(gen):
    ref = gen.generate(["Hello"], P)
    assert len(ref) == 1 and ref[0].prompt_tokens == 5
    for single in ("Hello", {"prompt": "Hello"}, {"prompt_ids": gen.encode("Hello")},
                   gen.encode("Hello")):
        outs = gen.generate(single, P)
        assert [o.token_ids for o in outs] == [ref[0].token_ids], single
        assert outs[0].prompt_tokens == 5
    msgs = {"messages": [{"role": "user", "content": "Hello"}]}
    assert gen.generate(msgs, P)[0].token_ids == gen.generate([msgs], P)[0].token_ids


@pytest.mark.parametrize("bad,needle", [
    ({"prompt": "Hi", "max_tokens": 4}, "unknown key"),
    ({"prompt": "Hi", "prompt_ids": [5]}, "exactly one"),
    ({"prompt": 5}, "must be a string"),
    ([[5, True, 6]], "non-empty list of integers"),
    ([""], "empty"),
    ([[]], "non-empty"),
    (["Hi", 3.5], "a prompt must be"),
    (b"Hello", "got bytes: decode it to a str first"),  # not 5 token ids
    (bytearray(b"Hi"), "got bytearray"),
    (None, "a list of prompts, got NoneType"),
    (7, "a list of prompts, got int"),
    # lone surrogates (invalid UTF-8 bytes on a command line, half a JSON \u pair)
    (["ab\udcff"], r"the prompt is not valid Unicode text: a lone surrogate \(U\+DCFF\) at "
                    r"character 2"),
    ({"messages": [{"role": "user", "content": "\ud800"}]},
     r"message 0's content is not valid Unicode text: a lone surrogate \(U\+D800\)"),
])
def test_bad_prompts_are_clear_errors(gen, bad, needle):
    with pytest.raises(ConfigError, match=needle):
        gen.generate(bad, P)
    with pytest.raises(ConfigError, match=needle):
        gen.validate(bad, P)


# -- memory ---------------------------------------------------------------------------------

def test_kv_bytes_match_the_allocation(tiny_dirs):
    """The estimate counts exactly what KVCache allocates for the same shape."""
    from ssdlib.capacity import kv_bytes_per_slot
    from ssdlib.engine.runner.kv_cache import KVCache
    from ssdlib.loading import load_checkpoint

    c = load_checkpoint(tiny_dirs["smol_heads"]).config
    for tp in (1, 2):
        kv_local = -(-c.num_key_value_heads // tp)
        cache = KVCache(c.num_hidden_layers, 3, kv_local, 100, c.head_dim, torch.float32, "cpu")
        nbytes = cache.k.numel() * 4 + cache.v.numel() * 4
        assert 3 * kv_bytes_per_slot(c, tp, 100, 4) == nbytes


def test_a_cache_that_cannot_fit_is_refused_with_what_fits(tiny_dirs, monkeypatch):
    import ssdlib.capacity as capacity
    import ssdlib.generator as generator
    from ssdlib.engine_config import EngineConfig
    from ssdlib.loading import load_checkpoint

    def no_ranks(*a, **k):
        raise AssertionError("models loaded for a configuration that cannot fit")

    monkeypatch.setattr(generator, "build_rank", no_ranks)
    monkeypatch.setattr(generator, "RankGroup", no_ranks)
    free = 50 * 10**6
    monkeypatch.setattr(capacity, "free_memory", lambda device, cuda_context=False: free)
    target = load_checkpoint(tiny_dirs["smol_heads"]).config
    draft = load_checkpoint(tiny_dirs["smol_heads_draft"]).config
    for mode in ("ar", "sd", "ssd"):
        kw = dict(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"], mode=mode)
        with pytest.raises(ConfigError, match="KV cache") as info:
            Generator(max_batch=100, max_len=2048, **kw)
        msg = str(info.value)
        assert "--max-batch 100 with --max-len 2048" in msg and "only 0.05 GB is free" in msg
        fit = int(msg.split("--max-batch ")[-1].split()[0])
        # the suggestion fits, one more slot does not
        capacity.check_memory(EngineConfig(max_batch=fit, max_len=2048, **kw), target, draft)
        with pytest.raises(ConfigError):
            capacity.check_memory(EngineConfig(max_batch=fit + 1, max_len=2048, **kw), target,
                                  draft)
        fit_len = int(msg.split("--max-len ")[-1].split()[0])
        capacity.check_memory(EngineConfig(max_batch=100, max_len=fit_len, **kw), target, draft)
        with pytest.raises(ConfigError):
            capacity.check_memory(EngineConfig(max_batch=100, max_len=fit_len + 1, **kw), target,
                                  draft)


def test_real_free_memory_refuses_an_absurd_batch(tiny_dirs):
    with pytest.raises(ConfigError, match="KV cache.*fits"):
        Generator(target=tiny_dirs["smol_heads"], max_batch=10**7, max_len=100_000)


@pytest.mark.parametrize("kw,needle", [
    (dict(target=5), "--target must be a checkpoint path or a named model, got 5"),
    (dict(target=None), "--target must be a checkpoint path or a named model, got None"),
    (dict(target="  "), "--target must be"),
    (dict(target="smollm2-135m", draft=["x"]), r"--draft must be a checkpoint path .* got \['x'\]"),
])
def test_a_model_that_is_not_a_path_is_a_clear_error(kw, needle):
    from ssdlib.engine_config import EngineConfig
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**kw)
    with pytest.raises(ConfigError, match=needle):
        Generator(**kw)
