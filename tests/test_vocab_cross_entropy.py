"""vocab_parallel_cross_entropy at tp = 1, 2, 4 against F.cross_entropy on the full logits: loss and logit
gradients, with padded vocab, ignore_index and label smoothing."""
import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo.parallel import get_tp_rank, get_tp_size, gather_tp_tensor, padded_vocab_size, vocab_parallel_cross_entropy
from tpzoo.testing import run_on_ranks

VOCAB = 37


def _check_loss(tp, smoothing, pad):
    tpzoo.init_parallel(tp=tp)
    vpad = padded_vocab_size(VOCAB, tp, 4 if pad else 1)  # 37 -> 37, 38, 40 (pad: 40, 40, 48)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, vpad, generator=g) * 3
    logits[..., VOCAB:] = 50.0  # padding would dominate the softmax if it were not excluded
    target = torch.randint(0, VOCAB, (3, 5), generator=g)
    target[0, 0], target[2, 4] = -100, -100
    target[1, 0], target[1, 1] = 0, VOCAB - 1
    dloss = torch.randn(3, 5, generator=g)

    ref_logits = logits[..., :VOCAB].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100,
                          label_smoothing=smoothing, reduction="none").view(3, 5)
    (ref * dloss).sum().backward()

    local = logits.chunk(tp, dim=-1)[get_tp_rank()].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing, vocab_size=VOCAB)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    (loss * dloss).sum().backward()
    full_grad = gather_tp_tensor(local.grad, -1)
    torch.testing.assert_close(full_grad[..., :VOCAB], ref_logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(full_grad[..., VOCAB:]) == 0  # padded entries get no gradient
    assert torch.all(loss[0, 0] == 0) and torch.all(full_grad[0, 0] == 0)  # ignored token
    # mean over non-ignored tokens is torch's reduction="mean"
    mean = loss.sum() / (target != -100).sum()
    ref_mean = F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1),
                               label_smoothing=smoothing)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-6)
    return get_tp_size()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_torch_cross_entropy(tp):
    for smoothing in (0.0, 0.1):
        for pad in (False, True):
            assert run_on_ranks(4, _check_loss, tp, smoothing, pad) == [tp] * 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), label_smoothing=1.0)
    with pytest.raises(ValueError, match="do not match"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))
