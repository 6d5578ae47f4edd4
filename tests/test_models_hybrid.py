"""The hybrid families end to end against transformers (the oracle; fp32, CPU): Qwen3.5 text (Qwen3_5ForCausalLM),
Qwen3.5-MoE (Qwen3_5MoeForCausalLM), Qwen3-Next (Qwen3NextForCausalLM), OLMo 3 (Olmo3ForCausalLM) and Kimi Linear
(KimiLinearForCausalLM), tiny models written by transformers itself (tests/hf_models.py: three Gated DeltaNet layers
of 4 key / 8 value heads and one gated attention layer, three sliding layers of window 8 and a full one, or three
Kimi Delta Attention layers of 4 heads and a NoPE latent attention layer; norms randomized), on sequences longer
than the linear attentions' chunk (64) and the window:
- `convert from-hf` at tp 2 -> `to-hf`: every tensor and config.json bit-exact;
- eval loss equal to transformers' (1e-5 relative) at tp 1, tp 2 + SP, pp 2, cp 2 (the Gated DeltaNet by
  all-to-all over heads, attention by ring) and ep 2 (the mixture-of-experts families), and at (tp, cp) = (2, 2) +
  SP (slow tier);
- greedy generation of 20 tokens after a 70-token prompt equal to transformers' at tp 1, tp 2 and pp 2 (each layer
  its own cache: KV for attention, the conv's tail and the recurrent state for the Gated DeltaNet);
- three SGD steps at tp 2 + SP, pp 2 and cp 2 equal to one process (losses, every gradient of the first step and
  every parameter after the last, 1e-5 of each tensor's largest entry); the trainer resumes a run bit for bit;
- a packed batch (document masking) equals its documents run one by one (loss and every gradient), and so do its
  runs at tp 2 + SP and cp 2 (Qwen3.5 and Kimi Linear);
  (these two in float64: the gradients of A_log and dt_bias, sums over every token of the decays' cumulative
  products, carry fp32 rounding of 2-4e-5 of their largest entry even in one process, measured against float64;
  in float64 every layout agrees with one process to about 1e-12, so the 1e-5 bound proves the split exact);
- the comparisons can fail: A_log / dt_bias swapped, the attention's output gate ignored, or the conv not reset
  at a document boundary each move the loss past the tolerance;
- a multimodal Qwen3.5 checkpoint is read for its text part; LoRA: Qwen3.5's in_proj_qkv adapter spans q|k|v
  (PEFT is the oracle: tests/test_lora_peft.py's qwen3_5 case), Qwen3-Next's grouped projections are refused;
  named configs' sizes equal their built models'.
"""
import json
import math

import pytest
import torch

import tpzoo
from tpzoo.checkpoint import convert_from_hf, convert_to_hf, load_model
from tpzoo.errors import ConfigError
from tpzoo.evaluation import evaluate
from tpzoo.generation import generate
from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config, get_config
from tpzoo.models.kinds import attention as attention_kind
from tpzoo.models.kinds import gated_deltanet as gdn_kind
from tpzoo.parallel import GradBuffer, comm
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

import test_3d_parity as p3
from checkpoint_helpers import assert_bit_exact, ids, safetensors_dir, write_hf
from hf_models import HYBRID_KINDS
from test_eval import _hf_loss
from test_models_2025 import _config

PROMPT, NEW = 70, 20  # a prompt longer than a chunk and the window, then 20 tokens through the caches
EVAL_SEQ = 72         # eval windows longer than a chunk
TRAIN_SEQ, TRAIN_BATCH = 72, 4  # three steps of 2 micro-batches of 2 rows
RTOL = 1e-5


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per family: the HF directory, its tp-2 tpzoo checkpoint, transformers' greedy tokens and eval loss."""
    root = tmp_path_factory.mktemp("hybrid")
    prompt, tokens = ids(batch=2, seq=PROMPT, seed=11), ids(batch=1, seq=2 * EVAL_SEQ + 9, seed=2)[0]
    out = {}
    for kind in HYBRID_KINDS:
        model = write_hf(kind, root / kind)
        convert_from_hf(root / kind, root / f"{kind}-t2", tp=2, pp=1, progress=False)
        with torch.no_grad():
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                 do_sample=False)
        out[kind] = (str(root / kind), str(root / f"{kind}-t2"), gen, _hf_loss(model, tokens, EVAL_SEQ)[0])
    return root, prompt, tokens, out


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_round_trip_at_tp2_is_bit_exact(cases, tmp_path, kind):
    root, *_ = cases
    convert_to_hf(root / f"{kind}-t2", tmp_path / "back", progress=False)
    assert_bit_exact(safetensors_dir(root / kind), safetensors_dir(tmp_path / "back"))
    assert _config(root / kind) == _config(tmp_path / "back")


# -- eval and generation at every layout ----------------------------------------------------------------------------

# eval / generate (cache) / both / eval / eval (the mixture-of-experts families only: the experts over 2 ranks)
LAYOUTS = [dict(tp=2, sp=True), dict(tp=2), dict(pp=2), dict(cp=2), dict(ep=2)]


def _eval_and_generate(items, prompt, tokens, layouts):
    """For each family (its checkpoint, whether it has experts) and layout: the eval result, and the greedy tokens
    where the layout generates."""
    out = []
    for ckpt, moe in items:
        per = []
        for lay in layouts:
            if lay.get("ep", 1) > 1 and not moe:
                per.append({})  # no experts to split
                continue
            tpzoo.init_parallel(tp=lay.get("tp", 1), pp=lay.get("pp", 1), cp=lay.get("cp", 1), ep=lay.get("ep", 1))
            try:
                model = load_model(ckpt, device="cpu", sequence_parallel=lay.get("sp", False)).eval()
                res = {}
                if lay.get("tp", 1) == 1 or lay.get("sp"):  # tp 2 without SP: its generation only
                    res["eval"] = evaluate(model, tokens, EVAL_SEQ, batch_size=2)["loss"]
                if lay.get("cp", 1) == 1 and lay.get("ep", 1) == 1 and not lay.get("sp"):
                    res["gen"] = generate(model, prompt, NEW)
                per.append(res)
            finally:
                tpzoo.destroy_parallel()
        out.append(per)
    return out


def _items(cases):
    root, *_, out = cases
    return [(out[k][1], from_hf_config(root / k).moe.num_experts > 0) for k in HYBRID_KINDS]


def _check(kind, what, res, ref_gen, ref_eval):
    if "eval" in res:
        assert math.isclose(res["eval"], ref_eval, rel_tol=RTOL), (kind, what, res["eval"], ref_eval)
    if "gen" in res:
        assert torch.equal(res["gen"], ref_gen), f"{kind} {what}: {res['gen'].tolist()} vs {ref_gen.tolist()}"


def test_eval_and_generation_match_transformers_at_every_layout(cases):
    _, prompt, tokens, out = cases
    for kind in HYBRID_KINDS:  # tp 1, here
        _, ckpt, gen, ev = out[kind]
        model = load_model(ckpt, device="cpu").eval()
        _check(kind, "tp=1", {"eval": evaluate(model, tokens, EVAL_SEQ, batch_size=2)["loss"],
                              "gen": generate(model, prompt, NEW)}, gen, ev)
    per_rank = run_on_ranks(2, _eval_and_generate, _items(cases), prompt, tokens, LAYOUTS)
    for r in per_rank:
        for k, kind in enumerate(HYBRID_KINDS):
            for lay, res in zip(LAYOUTS, r[k]):
                _check(kind, lay, res, out[kind][2], out[kind][3])


@pytest.mark.slow
def test_eval_at_tp2_cp2_with_sequence_parallelism(cases):
    _, prompt, tokens, out = cases
    layouts = [dict(tp=2, cp=2, sp=True)]
    for r in run_on_ranks(4, _eval_and_generate, _items(cases), prompt, tokens, layouts):
        for k, kind in enumerate(HYBRID_KINDS):
            _check(kind, layouts[0], r[k][0], out[kind][2], out[kind][3])


# -- the checks can fail ----------------------------------------------------------------------------------------------

def test_the_comparisons_can_fail(cases, monkeypatch):
    """A_log / dt_bias swapped, or the attention's output gate ignored: the eval loss moves 10x past the tolerance
    (1e-5)."""
    _, _, tokens, out = cases
    _, ckpt, _, ref = out["qwen3_5"]
    model = load_model(ckpt, device="cpu").eval()
    with torch.no_grad():
        for layer in model.layers.values():
            if isinstance(layer.attn, gdn_kind.GatedDeltaNet):
                a, d = layer.attn.A_log.clone(), layer.attn.dt_bias.clone()
                layer.attn.A_log.copy_(d)
                layer.attn.dt_bias.copy_(a)
    assert abs(evaluate(model, tokens, EVAL_SEQ)["loss"] / ref - 1) > 1e-4  # 10x the tolerance
    model = load_model(ckpt, device="cpu").eval()
    monkeypatch.setattr(attention_kind, "output_gate", lambda out, gate: out)
    assert abs(evaluate(model, tokens, EVAL_SEQ)["loss"] / ref - 1) > 1e-4  # 10x the tolerance


# -- packed documents ---------------------------------------------------------------------------------------------

DOCS = torch.tensor([[0] * 20 + [1] * 45 + [2] * 1 + [3] * 6, [0] * 66 + [1] * 6])  # 72 tokens a row


def _packed_batch(cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, cfg.vocab_size, DOCS.shape, generator=g)
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
    labels[:, :-1][DOCS[:, 1:] != DOCS[:, :-1]] = -100  # no label across a document boundary
    return x, labels


def _per_document(cfg) -> dict:
    """Loss sum and gradients of the documents run one by one in one process (gradients summed)."""
    model = Transformer(cfg, seed=p3.SEED)
    x, labels = _packed_batch(cfg)
    total = 0.0
    for row in range(x.shape[0]):
        for d in DOCS[row].unique():
            idx = (DOCS[row] == d).nonzero().flatten()
            per_token = model(Inputs(x[row:row + 1, idx], labels=labels[row:row + 1, idx]))
            per_token.sum().backward()
            total += per_token.sum().item()
    return {"loss": total, "grads": {n: p3._full(n, p.grad, cfg) for n, p in model.named_parameters()}}


def _packed_here(cfg) -> dict:
    """The packed batch in one process: loss sum and gradients."""
    model = Transformer(cfg, seed=p3.SEED)
    x, labels = _packed_batch(cfg)
    per_token = model(Inputs(x, labels=labels, doc_ids=DOCS))
    per_token.sum().backward()
    return {"loss": per_token.sum().item(), "grads": {n: p3._full(n, p.grad, cfg) for n, p in model.named_parameters()}}


def _packed(cfg, layouts):
    """The packed batch's loss sum and full gradients at each layout (one micro-batch, doc_ids given)."""
    out = []
    x, labels = _packed_batch(cfg)
    for lay in layouts:
        dims = tpzoo.init_parallel(tp=lay.get("tp", 1), cp=lay.get("cp", 1))
        try:
            chunks = build_model_chunks(cfg, dims, sequence_parallel=lay.get("sp", False), seed=p3.SEED)
            params = list({id(p): p for c in chunks for p in c.parameters()}.values())
            main_grads = GradBuffer(params, device=dims.device)
            mb = shard_batch({"input_ids": x, "labels": labels, "doc_ids": DOCS}, dims, lay.get("sp", False))
            res = forward_backward(chunks, [mb], dims, loss_scale=1.0)
            finalize_grads(chunks, dims)
            main_grads.reduce(dims.grad_group)
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
            total = torch.tensor([res["loss_sum"]], dtype=torch.float64)
            comm.all_reduce(total, dims.grad_group)  # each cp rank's tokens
            out.append({"loss": float(total), "grads": p3._gathered(chunks, cfg, grad=True)})
        finally:
            tpzoo.destroy_parallel()
    return out


def _packed_families(cfgs, layouts):
    return [_exact(_packed, cfg, layouts) for cfg in cfgs]


PACKED_KINDS = ("qwen3_5", "kimi_linear")  # Gated DeltaNet + gated attention; Kimi Delta Attention + NoPE MLA + MoE


def test_packed_documents_equal_the_documents_alone(cases, monkeypatch):
    """Qwen3.5 and Kimi Linear with document masking: one packed micro-batch in one process equals its 6 documents
    run one by one (loss, every gradient), and at tp 2 + SP and cp 2 it equals the one process's; with the conv not
    reset at document starts it does not."""
    root, *_ = cases
    cfgs = [from_hf_config(root / kind) for kind in PACKED_KINDS]
    layouts = [dict(tp=2, sp=True), dict(cp=2)]
    per_rank = _double(run_on_ranks(2, _packed_families, cfgs, layouts))
    for k, (kind, cfg) in enumerate(zip(PACKED_KINDS, cfgs)):
        ref, here = _exact(_per_document, cfg), _exact(_packed_here, cfg)
        results = [(here, ref, "packed vs documents")] + [
            (r[k][i], here, f"{layouts[i]} vs one process") for r in per_rank for i in range(len(layouts))]
        for res, want, what in results:
            what = f"{kind} {what}"
            assert math.isclose(res["loss"], want["loss"], rel_tol=RTOL), (what, res["loss"], want["loss"])
            for name, g in res["grads"].items():
                p3.assert_close(g, want["grads"][name], f"{what}: grad {name}")
    ref = _exact(_per_document, cfgs[0])
    conv = gdn_kind.causal_conv
    monkeypatch.setattr(gdn_kind, "causal_conv", lambda x, w, past=None, starts=None: conv(x, w, past, None))
    assert abs(_exact(_packed_here, cfgs[0])["loss"] / ref["loss"] - 1) > 1e-4


# -- training against one process ---------------------------------------------------------------------------------

TRAIN_LAYOUTS = [dict(tp=2, sp=True), dict(tp=1, pp=2), dict(tp=1, cp=2)]


def _cp_layout(cfg, layout: dict) -> dict:
    """test_3d_parity.train_layout at a cp layout: each micro-batch of the step sharded over the cp ranks."""
    dims = tpzoo.init_parallel(tp=layout["tp"], cp=layout["cp"])
    try:
        chunks = build_model_chunks(cfg, dims, seed=p3.SEED)
        params = list({id(p): p for c in chunks for p in c.parameters()}.values())
        opt, main_grads = p3.make_optimizer(params), GradBuffer(params, device=dims.device)
        losses, grads = [], {}
        for step in range(p3.STEPS):
            mbs, tokens = p3.local_microbatches(cfg, step)
            main_grads.zero()
            out = forward_backward(chunks, [shard_batch(mb, dims) for mb in mbs], dims, loss_scale=1.0 / tokens)
            finalize_grads(chunks, dims)
            main_grads.reduce(dims.grad_group)
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
            losses.append(out["loss_sum"])
            if step == 0:
                grads = p3._gathered(chunks, cfg, grad=True)
            opt.step()
        replicated = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()
                      if getattr(p, "tp_spec", None) is None or p.tp_spec.dim is None}
        return {"coords": (dims.tp_rank, 0, 0), "loss_sum": losses, "grads": grads,
                "params": p3._gathered(chunks, cfg, grad=False), "replicated": replicated}
    finally:
        tpzoo.destroy_parallel()


def _exact(fn, *args):
    """Run `fn` in float64 (the module docstring), with test_3d_parity's batch shaped for these models (sequences
    longer than a chunk)."""
    saved = p3.SEQ, p3.GLOBAL_BATCH, torch.get_default_dtype()
    p3.SEQ, p3.GLOBAL_BATCH = TRAIN_SEQ, TRAIN_BATCH
    torch.set_default_dtype(torch.float64)
    try:
        return fn(*args)
    finally:
        p3.SEQ, p3.GLOBAL_BATCH = saved[:2]
        torch.set_default_dtype(saved[2])


def _double(obj):
    """Every floating tensor in a result as float64 (the float64 models' gradients come as fp32 main grads)."""
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _double(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_double(v) for v in obj)
    return obj


def _train_layouts(cfgs, layouts):
    return _double([[_exact(_cp_layout if lay.get("cp", 1) > 1 else p3.train_layout, cfg, lay) for lay in layouts]
                    for cfg in cfgs])


def test_training_at_tp2_sp_pp2_cp2_matches_one_process(cases):
    root, *_ = cases
    # the default init (0.02): from the oracle models' 0.1-scale weights, test_3d_parity's lr 0.5 diverges (the loss
    # grows) and the fp32 main grads' rounding (6e-8) grows ~1000x in three steps; at 0.02 it stays ~2e-7
    cfgs = [from_hf_config(root / kind).replace(initializer_range=0.02) for kind in HYBRID_KINDS]
    per_rank = run_on_ranks(2, _train_layouts, cfgs, TRAIN_LAYOUTS)
    for i, cfg in enumerate(cfgs):
        ref = _exact(p3.reference, cfg)
        for j, layout in enumerate(TRAIN_LAYOUTS):
            p3.check_layout(cfg, ref, [r[i][j] for r in per_rank], {**layout, "family": cfg.family})


# -- a multimodal checkpoint's text part, LoRA, configs ---------------------------------------------------------------

def test_a_multimodal_checkpoint_is_read_for_its_text_part(cases, tmp_path):
    """Qwen3_5ForConditionalGeneration's layout (text_config; the decoder under model.language_model., a vision
    tower and an MTP head beside it): the text model's logits; to-hf writes the config as it was and the text
    tensors under their names, the vision and MTP tensors left out."""
    from safetensors.torch import save_file

    root, prompt, *_ = cases
    text = safetensors_dir(root / "qwen3_5")
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in text.items()}
    extra = {"model.visual.patch_embed.proj.weight": torch.ones(4, 3), "mtp.fc.weight": torch.ones(2, 2)}
    src = tmp_path / "vl"
    src.mkdir()
    save_file({**tensors, **extra}, str(src / "model.safetensors"))
    text_cfg = _config(root / "qwen3_5")
    hf = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config":
          {**text_cfg, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (src / "config.json").write_text(json.dumps(hf))
    ours = load_model(str(src), device="cpu").eval()
    plain = load_model(str(root / "qwen3_5"), device="cpu").eval()
    with torch.no_grad():
        assert torch.equal(ours.full_logits(ours(prompt)), plain.full_logits(plain(prompt)))
    convert_from_hf(src, tmp_path / "ckpt", tp=2, progress=False)
    convert_to_hf(tmp_path / "ckpt", tmp_path / "back", progress=False)
    assert_bit_exact(tensors, safetensors_dir(tmp_path / "back"))
    assert _config(tmp_path / "back") == hf


def test_lora_on_the_grouped_qwen3_next_projections_is_refused(cases):
    from tpzoo.models.lora import LoRAConfig, add_lora

    root, *_ = cases
    model = Transformer(from_hf_config(root / "qwen3_next"), ModelLayout(device="meta"))
    for targets in ("in_proj_qkvz", "all-linear"):
        with pytest.raises(ConfigError, match="in_proj_qkvz.* cannot take adapters") as e:
            add_lora([model], LoRAConfig(4, 8, targets=targets))
        assert "\n" not in str(e.value)
    add_lora([model], LoRAConfig(4, 8, targets="q_proj,out_proj,down_proj"))  # the other projections take them


NAMED = ["qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "olmo-3-7b", "nano-qwen3.5", "nano-qwen3-next",
         "nano-olmo3"]
# the published totals in billions, to the names' precision (the text models: Qwen3.5's checkpoints add a vision
# tower, ~0.4B, and every Qwen one a multi-token-prediction layer); "A3B": about 3B parameters per token
PUBLISHED = {"qwen3.5-27b": 27, "qwen3.5-35b-a3b": 35, "qwen3-next-80b-a3b": 80, "olmo-3-7b": 7}


@pytest.mark.parametrize("name", NAMED)
def test_named_configs_count_what_they_build(name):
    """ModelConfig.num_parameters (each kind's own count) equals the built model's, on a 4-layer cut with the
    named config's widths (built on meta); the published totals, and active counts where they are stated."""
    cfg = get_config(name)
    cut = cfg.replace(num_layers=4, token_mixers=cfg.token_mixers and cfg.token_mixers[:4],
                      layer_types=cfg.attention.layer_types and cfg.attention.layer_types[:4])
    built = Transformer(cut, ModelLayout(device="meta"))
    assert sum(p.numel() for p in built.parameters()) == cut.num_parameters()
    if name in PUBLISHED:
        assert round(cfg.num_parameters() / 1e9) == PUBLISHED[name]
    if name.endswith("a3b"):
        assert 2.5e9 < cfg.num_parameters(active=True) < 4e9


# -- the trainer resumes exactly --------------------------------------------------------------------------------------

def _three_runs(base: dict, run: str) -> list[dict]:
    """The trainer on this rank: 3 steps straight; 2 steps saving; the saved run resumed to step 3."""
    from tpzoo.train import load_config, train

    return [train(load_config(None, base)),
            train(load_config(None, {**base, "steps": 2, "save": run, "save_every": 2})),
            train(load_config(None, {**base, "save": run, "resume": "auto"}))]


def test_the_trainer_resumes_exactly(tmp_path):
    """`tpzoo pretrain` of nano-qwen3-next (Gated DeltaNet, gated attention, MoE with the gated shared expert) at
    tp 2 + SP on 72-token rows: a run saved at step 2 and resumed gives step 3's loss and grad norm bit for bit."""
    import sysconfig
    from pathlib import Path

    from tpzoo.data import iter_documents, preprocess

    lib = Path(sysconfig.get_paths()["stdlib"])
    store = str(preprocess(iter_documents([str(lib / "textwrap.py")]), "byte", tmp_path / "store").path)
    base = dict(model="nano-qwen3-next", data=[store], seq_len=72, global_batch_size=2, micro_batch_size=1, steps=3,
                lr=3e-3, warmup_steps=1, min_lr=3e-4, tp=2, sequence_parallel=True, save="", sample_prompt="",
                quiet=True, log_interval=100, eval_fraction=0.0, seed=0, prefetch=1)
    straight, saved, resumed = run_on_ranks(2, _three_runs, base, str(tmp_path / "run"))[0]
    assert saved["losses"] == straight["losses"][:2]
    assert resumed["steps"] == [3] and resumed["losses"][-1] == straight["losses"][-1]
    assert resumed["grad_norms"][-1] == straight["grad_norms"][-1]


# -- pipeline stages weigh each layer's kinds ---------------------------------------------------------------------

def test_pipeline_stages_weigh_each_layer_kind(monkeypatch):
    """Qwen3-Next's layers with the first 8 dense (mlp_only_layers: a dense-first stack) at pp 4: the most expensive
    stage (its layers' parameters by their kinds, the embedding on the first, the head on the last) is the least any
    split into 4 consecutive ranges gives (all of them tried), and 10% less than counting every layer as the
    average one (the partition before layer kinds) gives."""
    import itertools

    from tpzoo.pipeline import partition

    cfg = get_config("qwen3-next-80b-a3b").replace(mlp_only_layers=list(range(8)))
    costs, n = partition.layer_parameters(cfg), cfg.num_layers
    assert len(set(costs)) == 4  # Gated DeltaNet or attention, dense MLP or experts
    embed = cfg.vocab_size * cfg.hidden_size
    extra = [embed, 0, 0, embed + cfg.hidden_size]

    def worst(ranges):
        return max(sum(costs[a:b]) + e for (a, b), e in zip(ranges, extra))

    ranges = partition.partition_layers(cfg, 4)
    assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]] and ranges[0][0] == 0 and ranges[-1][1] == n
    best = min(worst(list(zip((0, *cuts), (*cuts, n)))) for cuts in itertools.combinations(range(1, n), 3))
    assert worst(ranges) == best
    monkeypatch.setattr(partition, "layer_parameters", lambda cfg: [1] * cfg.num_layers)  # every layer the average
    assert worst(partition.partition_layers(cfg, 4)) > 1.1 * best
