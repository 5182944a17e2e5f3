import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers

from kvconnect.model.config import TINY, ModelConfig
from kvconnect.model.llama import AttentionMetadata, Linear, LlamaForCausalLM, paged_attention
from kvconnect.model.loader import load_model, shard_dim, tiny_state_dict
from kvconnect.model.tokenizer import ByteTokenizer


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The textbook formula, GQA by repeating KV heads. q: [T, H, D], k/v: [T, KV, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    t = q.shape[0]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


@pytest.mark.parametrize(
    ("lens", "new"),
    [
        ([13, 7, 1], [5, 7, 1]),  # a later chunk, a whole prompt, a one-token prompt
        ([13, 6, 2, 9, 5], [1, 6, 1, 3, 1]),  # decode rows (one batched call) between others
    ],
)
def test_paged_attention_matches_dense_attention_for_chunks_and_scattered_blocks(
    lens: list[int], new: list[int]
) -> None:
    """`new[i]` last tokens of request i are this step's; the whole context is cached."""
    torch.manual_seed(0)
    heads, kv_heads, d, bs, num_blocks = 8, 2, 16, 4, 32
    cache = torch.zeros(2, num_blocks, bs, kv_heads, d, dtype=torch.float64)
    perm = torch.randperm(num_blocks).tolist()
    tables: list[list[int]] = []
    qs, refs = [], []
    for n in lens:
        nb = -(-n // bs)
        table, perm = perm[:nb], perm[nb:]
        q = torch.randn(n, heads, d, dtype=torch.float64)
        k = torch.randn(n, kv_heads, d, dtype=torch.float64)
        v = torch.randn(n, kv_heads, d, dtype=torch.float64)
        for p in range(n):  # the whole context is in the cache
            cache[0, table[p // bs], p % bs], cache[1, table[p // bs], p % bs] = k[p], v[p]
        tables.append(table)
        qs.append(q)
        refs.append(dense_causal_attention(q, k, v))
    q_new = torch.cat([q[-m:] for q, m in zip(qs, new, strict=True)])
    meta = AttentionMetadata(new, lens, tables, torch.zeros(0, dtype=torch.long), bs)
    out = paged_attention(q_new, cache, meta)
    assert (meta.decode_batch() is not None) == (new.count(1) > 2)
    expected = torch.cat([r[-m:] for r, m in zip(refs, new, strict=True)])
    torch.testing.assert_close(out, expected)


def write_checkpoint(tmp: Path, arch: str, intermediate_size: int = 128) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(1)
    config = cfg_cls(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=arch == "qwen2",
        eos_token_id=3,
    )
    model = model_cls(config).eval()
    path = tmp / arch
    model.save_pretrained(path, safe_serialization=True)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"[UNK]": 26}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def run_paged(model: LlamaForCausalLM, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, computed chunk by chunk through the paged cache."""
    bs = 4
    table = list(range(31, 31 - (len(ids) // bs + 1), -1))  # blocks in reverse order
    caches = [torch.zeros(model.kv_cache_shape(32, bs)) for _ in model.layer_names]
    out = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        pos = list(range(start, start + len(part)))
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in pos])
        meta = AttentionMetadata([len(part)], [start + len(part)], [table], slots, bs)
        with torch.no_grad():
            h = model(torch.tensor(part), torch.tensor(pos), caches, meta)
            out.append(model.compute_logits(h))
    return torch.cat(out)


@pytest.mark.heavy
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpoint_loads_and_matches_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(tmp_path, arch)
    model, tokenizer = load_model(str(path))
    assert model.config.architecture == (
        "Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"
    )
    assert model.config.attention_bias == (arch == "qwen2")
    assert tokenizer.encode("a b c") == [0, 1, 2] and tokenizer.eos_token_id == 3
    ids = [5, 9, 33, 2, 7, 1, 3, 60, 42, 17, 11]
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    for chunk in (len(ids), 3, 1):
        torch.testing.assert_close(run_paged(model, ids, chunk), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.heavy
def test_tensor_parallel_shards_partition_the_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = write_checkpoint(tmp_path, "llama")
    full = load_file(str(path / "model.safetensors"))
    shards = [dict(load_model(str(path), rank=r, tp=2)[0].named_parameters()) for r in (0, 1)]
    for name, tensor in full.items():
        dim = shard_dim(name)
        got = [s[name].detach() for s in shards]
        if dim is None:
            assert all(torch.equal(g, tensor) for g in got), name
        else:
            assert torch.equal(torch.cat(got, dim=dim), tensor), name


def test_bad_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_model(str(tmp_path))
    del llama["rope_scaling"]
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_model(str(tmp_path))
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json")
    )
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(tmp_path))
    llama["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match="rope_parameters"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", dtype="int8")


def test_tensor_parallel_size_must_divide_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"num_key_value_heads=4"):
        TINY.check_tensor_parallel(8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=2,
        )


def test_tiny_weights_are_deterministic_and_sharded_consistently() -> None:
    a, b = tiny_state_dict(seed=0), tiny_state_dict(seed=0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], tiny_state_dict(seed=1)["lm_head.weight"])
    m0, _ = load_model("tiny", rank=0, tp=2)
    q = m0.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(q, a["model.layers.0.self_attn.q_proj.weight"][: q.shape[0]])


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.decode([104, 105, tok.eos_token_id or 0]) == "hi"


def test_packed_projections_compute_what_torchs_linear_computes() -> None:
    """`Linear.pack()` (oneDNN, reordered weight) against `F.linear` on the same weight, for
    a decode row, a decode batch and a prefill's worth of rows, with and without bias."""
    torch.manual_seed(0)
    for bias in (False, True):
        layer = Linear(96, 160, bias=bias)
        layer.pack()
        assert layer.packed is not None or not torch.backends.mkldnn.is_available()
        for rows in (1, 16, 300):
            x = torch.randn(rows, 96)
            expected = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_a_loaded_float32_model_runs_packed_and_other_dtypes_do_not() -> None:
    fp32, _ = load_model("tiny")
    bf16, _ = load_model("tiny", dtype="bfloat16")
    projections = [m for m in fp32.modules() if isinstance(m, Linear)]
    assert len(projections) == 7 * TINY.num_hidden_layers + 1  # q k v o gate up down, head
    if torch.backends.mkldnn.is_available():
        assert all(m.packed is not None for m in projections)
    assert all(m.packed is None for m in bf16.modules() if isinstance(m, Linear))
