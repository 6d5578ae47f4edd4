"""DPO (tpzoo.post.dpo) against a plain-torch reference written from the formulas on transformers' model.

- the sigmoid loss, TRL's rewards/accuracies and margins, and every gradient, at tp 2 + SP, pp 2, dp 2 and cp 2
  (float64 models, fp32 main gradients: 1e-5); IPO at tp 2 + SP and conservative DPO at cp 2 the same way;
- LoRA's reference (the adapters switched off) equals a frozen copy of the base, bit for bit;
- a pair whose chosen and rejected responses sit in different micro-batches is refused on every rank;
- end to end: `finetune --objective dpo --lora-rank` (tp 2 + SP) starts at log 2 with zero rewards, logs TRL's
  metrics, and `tpzoo eval --objective dpo` (at pp 2) on the held-out pairs reports the trainer's held-out loss
  and rewards.
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tpzoo.errors import DataError
from tpzoo.post.dpo import METRICS, DPOSettings, dpo_pass
from tpzoo.post.dpo_data import PreferenceDataset
from tpzoo.post.dpo_reference import LiveReference
from tpzoo.post.reference import adapters_disabled
from tpzoo.testing import run_on_ranks

from hf_models import VOCAB
from post_helpers import (assert_grads, at_layout, backward_and_gather, cli_on_rank, grads_in_tpzoo_names, hf_model,
                          hf_pair, load, rank_batches)

SEQ = 24
SETTINGS = {"sigmoid": DPOSettings(0.5), "ipo": DPOSettings(0.5, "ipo"), "cdpo": DPOSettings(0.5, "sigmoid", 0.2)}
LAYOUTS = [dict(tp=2, sp=True), dict(pp=2), dict(dp=2), dict(cp=2)]
# the sigmoid loss at every layout; IPO and conservative DPO (another formula on the same sums) at one each
CASES = [(lay, "sigmoid") for lay in LAYOUTS] + [(LAYOUTS[0], "ipo"), (LAYOUTS[3], "cdpo")]


def make_pairs(n: int = 8, seed: int = 3) -> list:
    """n pairs of random token ids: a shared prompt (untrained) and two completions (trained, of other lengths)."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        sides = []
        for _ in range(2):
            done = torch.randint(0, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            sides.append((prompt + done, [False] * len(prompt) + [True] * len(done)))
        pairs.append(tuple(sides))
    return pairs


def hf_logps(model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probabilities [n, 2] of each pair's (chosen, rejected) trained tokens, their numbers [n, 2]) under
    a transformers model: every response in one right-padded batch."""
    seqs = [side for pair in pairs for side in pair]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask, attend = torch.zeros(len(seqs), width, dtype=torch.bool), torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (tokens, trained) in enumerate(seqs):
        ids[i, :len(tokens)], mask[i, :len(tokens)], attend[i, :len(tokens)] = (torch.tensor(tokens),
                                                                              torch.tensor(trained), 1)
    logits = model(input_ids=ids, attention_mask=attend).logits[:, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    return lp.sum(1).view(-1, 2), mask[:, 1:].sum(1).view(-1, 2).double()


def hf_dpo(policy, reference, pairs) -> dict:
    """Each setting's DPO loss over `pairs`, written from the formulas, on transformers' models: {name: (metrics,
    the policy's gradients in parameter order)}."""
    pi, n = hf_logps(policy, pairs)
    with torch.no_grad():
        ref, _ = hf_logps(reference, pairs)
    rho = pi - ref  # log-ratios (chosen, rejected)
    out = {}
    for name, s in SETTINGS.items():
        if s.loss == "ipo":  # IPO (Azar et al.), each log-ratio averaged over its response tokens (TRL)
            losses = ((rho[:, 0] / n[:, 0] - rho[:, 1] / n[:, 1]) - 1 / (2 * s.beta)) ** 2
        else:  # DPO (Rafailov et al.); conservative DPO (Mitchell) with label smoothing
            z = s.beta * (rho[:, 0] - rho[:, 1])
            losses = -(1 - s.label_smoothing) * F.logsigmoid(z) - s.label_smoothing * F.logsigmoid(-z)
        loss = losses.mean()
        grads = torch.autograd.grad(loss, list(policy.parameters()), retain_graph=True)
        chosen, rejected = (s.beta * rho.detach()).unbind(1)
        out[name] = ({"loss": loss.item(), "rewards/chosen": chosen.mean().item(),
                      "rewards/rejected": rejected.mean().item(),
                      "rewards/accuracies": (chosen > rejected).double().mean().item(),
                      "rewards/margins": (chosen - rejected).mean().item()}, grads)
    return out


def _dpo_layouts(dirs, pairs, cases) -> list:
    dataset = PreferenceDataset(pairs, SEQ, pad_id=0)

    def run(dims, lay):
        out = []
        ref = load(dirs[1], dims, lay, frozen=True)
        for name in [name for layout, name in cases if layout == lay]:
            s = SETTINGS[name]
            chunks = load(dirs[0], dims, lay)
            batches = rank_batches(dataset, dims, lay.get("sp", False))
            totals = {}

            def step():
                logps = LiveReference(ref, dims, "ref").logps(batches)
                totals.update(dpo_pass(chunks, batches, dims, s, logps, scale=1 / len(dataset)))
                return totals["loss"]

            loss, grads = backward_and_gather(chunks, dims, step)
            out.append({"layout": lay, "settings": name, "rank": dims.rank, "loss": loss, "grads": grads,
                        "coords": (dims.tp_rank, dims.pp_rank, dims.dp_rank, dims.cp_rank),
                        **{k: totals[k] for k in (*METRICS, "pairs")}})
        return out
    return [r for lay in LAYOUTS for r in at_layout(lay, run)]


def _lora_reference(dirs, pairs) -> dict:
    """LoRA at tp 2 with random adapters: the reference pass with the adapters switched off, and a frozen copy of
    the base; the policy's own pass (adapters on) differs."""
    from tpzoo.models.lora import LoRAConfig, add_lora

    dataset = PreferenceDataset(pairs, SEQ, pad_id=0)

    def run(dims, lay):
        chunks = load(dirs[0], dims, lay, frozen=True)
        add_lora(chunks, LoRAConfig(4, 8.0))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, p in chunks[0].named_parameters():
                if ".lora." in n:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
        batches = rank_batches(dataset, dims, lay.get("sp", False))
        off = LiveReference(chunks, dims, "off", lambda: adapters_disabled(chunks)).logps(batches)
        base = LiveReference(load(dirs[0], dims, lay, frozen=True), dims, "base").logps(batches)
        on = LiveReference(chunks, dims, "on").logps(batches)
        return [{"off": off, "base": base, "on": on}]
    return at_layout(dict(tp=2, sp=True), run)[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return hf_pair("llama", tmp_path_factory.mktemp("dpo"))


def test_dpo_loss_rewards_and_gradients_match_transformers_at_every_layout(models, tmp_path):
    pairs = make_pairs()
    results = run_on_ranks(2, _dpo_layouts, models, pairs, CASES)
    policy = hf_model(models[0])
    for name, (want, grads) in hf_dpo(policy, hf_model(models[1]), pairs).items():
        for p, g in zip(policy.parameters(), grads):
            p.grad = g
        want_grads = grads_in_tpzoo_names(policy, tmp_path / name)
        for lay in [layout for layout, case in CASES if case == name]:
            ranks = [r for per_rank in results for r in per_rank if r["layout"] == lay and r["settings"] == name]
            what = f"{name} at {lay}"
            for r in ranks:
                assert r["loss"] / len(pairs) == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), what
            heads = [r for r in ranks if r["coords"][:2] == (0, 0)]  # one copy of each dp x cp rank's share
            n = sum(r["pairs"] for r in heads)
            assert n == len(pairs), what
            for k in METRICS[:4]:
                got = sum(r[k] for r in heads) / n
                assert got == pytest.approx(want[k], rel=1e-5, abs=1e-7), f"{what}: {k}"
            assert_grads(ranks, want_grads, what)
    assert 0 < want["rewards/accuracies"] < 1  # the accuracies compared above are not trivially all 0 or all 1


def test_lora_reference_is_the_base_without_adapters(models):
    res = run_on_ranks(2, _lora_reference, models, make_pairs(4))
    for r in res:
        for off, base, on in zip(r["off"], r["base"], r["on"]):
            if base is None:  # not the last stage
                continue
            assert torch.equal(off, base)
            assert not torch.allclose(on, base)  # the adapters do change the log-probabilities


def test_a_pair_split_across_micro_batches_is_refused(models):
    """Chosen in one micro-batch, rejected in the next: refused, never paired with another row's response."""
    from tpzoo.parallel.state import get_dims

    pairs = make_pairs(2)
    dataset = PreferenceDataset(pairs, SEQ, pad_id=0)
    rows = [dataset[0], dataset[1]]
    dims = get_dims()
    whole = [{k: torch.as_tensor(v)[None] for k, v in row.items()} for row in rows]
    split = [dict(b) for b in whole]
    for i, keep in ((0, 1), (1, 2)):  # micro-batch 0 keeps pair 0's chosen only, micro-batch 1 pair 1's rejected
        split[i]["labels"] = torch.where(split[i]["dpo_seq"] == keep, split[i]["labels"], -100)
    chunks = load(models[0], dims, {})
    zeros = [torch.zeros(1, 2, dtype=torch.float64)] * 2
    out = dpo_pass(chunks, whole, dims, DPOSettings(), zeros)
    assert out["pairs"] == 2
    with pytest.raises(DataError, match="different micro-batches"):
        dpo_pass(chunks, split, dims, DPOSettings(), zeros)


def test_preference_data_rows_and_masks():
    """A pair's row (chosen, rejected, padding as three documents); the chat form trains only the completions (a
    shared assistant turn of the prompt is not trained); a pair too long is cut from its longer side; the held-out
    rows are numbered after the training rows."""
    from tpzoo.data.sft import encode_sft_example
    from tpzoo.post.dpo_data import build_preference_datasets, encode_pair

    tok = "byte"
    rec = {"prompt": "hi", "chosen": "yes", "rejected": "no!"}
    (c_ids, c_mask), (r_ids, r_mask) = encode_pair(rec, tok, "fallback")
    assert (c_ids, c_mask) == encode_sft_example({"prompt": "hi", "response": "yes"}, tok, template="fallback")
    row = PreferenceDataset([((c_ids, c_mask), (r_ids, r_mask))], 64, pad_id=0)[0]
    a, b = len(c_ids) - 1, len(r_ids) - 1
    assert row["dpo_seq"].tolist() == [1] * a + [2] * b + [0] * (64 - a - b)
    assert row["doc_ids"].tolist() == [0] * a + [1] * b + [2] * (64 - a - b)
    assert row["position_ids"][a] == 0 and (row["labels"][:a] != -100).sum() == sum(c_mask[1:]) == len("yes") + 1

    shared = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bb"},
              {"role": "user", "content": "c"}]
    chat = {"chosen": shared + [{"role": "assistant", "content": "ddd"}],
            "rejected": shared + [{"role": "assistant", "content": "e"}]}
    (ids, mask), (ids_r, mask_r) = encode_pair(chat, tok, "fallback")
    trained = bytes(i for i, m in zip(ids, mask) if m and i < 256)
    assert trained == b"ddd" and sum(mask) == 4 and sum(mask_r) == 2  # the completion and its EOS only

    sides = ((list(range(40)), [False] * 10 + [True] * 30), (list(range(9)), [False, True] * 4 + [True]))
    long = PreferenceDataset([sides], 24, pad_id=0)
    c, r = long.pairs[0]
    assert (len(c[0]) - 1, len(r[0]) - 1) == (16, 8)  # the longer side cut, the shorter kept
    records = [dict(rec, chosen=f"yes{i}") for i in range(10)]
    train, held = build_preference_datasets(records, tok, 64, eval_fraction=0.2, template="fallback")
    assert (len(train), len(held)) == (8, 2) and held[0]["dpo_row"] == 8 and held[1]["dpo_row"] == 9


# -- end to end --------------------------------------------------------------------------------------------------

WORDS = "the quick brown fox jumps over the lazy dog".split()


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    from checkpoint_helpers import write_hf

    path = tmp_path_factory.mktemp("base") / "llama"
    write_hf("llama", path, tokenizer=True)
    return path


def write_prefs(path, n: int = 24) -> list:
    records = []
    for i in range(n):
        a, b = WORDS[i % 9], WORDS[(2 * i + 1) % 9]
        records.append({"prompt": f"{a} {b}", "chosen": f"{a} the {b}", "rejected": f"{b} {b} {a} dog"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_finetune_dpo_with_lora_logs_trl_metrics_and_eval_agrees(hf_base, tmp_path):
    from tpzoo.data.sft import split_records

    prefs = tmp_path / "prefs.jsonl"
    records = write_prefs(prefs)
    save = tmp_path / "run"
    argv = ["finetune", "--base", hf_base, "--data", prefs, "--objective", "dpo", "--lora-rank", 4, "--tp", 2,
            "--sequence-parallel", "--seq-len", 32, "--global-batch-size", 8, "--micro-batch-size", 4, "--steps", 3,
            "--lr", 1e-2, "--warmup-steps", 0, "--eval-fraction", 0.25, "--dpo-beta", 0.5, "--save", save]
    assert [rc for rc, _ in run_on_ranks(2, cli_on_rank, argv)] == [0, 0]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference before the first step
    assert rows[0]["rewards/margins"] == 0 and rows[0]["rewards/accuracies"] == 0 and rows[0]["pairs"] == 8
    for k in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert k in rows[-1]
    assert rows[-1]["rewards/margins"] > 0 and rows[-1]["loss"] < math.log(2)
    from tpzoo.train.metrics import format_line

    line = format_line(rows[-1])  # the step line
    assert f"| acc {rows[-1]['rewards/accuracies']:.3f} margin {rows[-1]['rewards/margins']:.4f}" in line

    _, held = split_records(records, 0.25, 1234)  # the trainer's held-out pairs (seed: the default)
    held_file = tmp_path / "held.jsonl"
    held_file.write_text("".join(json.dumps(r) + "\n" for r in held))
    (rc, out), _ = run_on_ranks(2, cli_on_rank, ["eval", save / "step_00000003", "--objective", "dpo", "--data",
                                                 held_file, "--seq-len", 32, "--dpo-beta", 0.5, "--batch-size", 3,
                                                 "--pp", 2])  # another layout than the run's
    assert rc == 0
    got = json.loads(out.strip().splitlines()[-1])
    assert got["pairs"] == len(held)
    assert got["loss"] == pytest.approx(rows[-1]["eval_loss"], rel=1e-5)
    for k in ("rewards/accuracies", "rewards/margins"):
        assert got[k] == pytest.approx(rows[-1][f"eval_{k}"], rel=1e-5, abs=1e-7)
