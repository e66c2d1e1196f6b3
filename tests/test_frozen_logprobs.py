"""The KL reference's log-probs (`monorl.train.frozen`, as the distillation teacher's): a forward over the student's
own packs, kept on the device, instead of a second packing and a host round trip."""

from collections.abc import Sequence

import pytest
import torch

from monorl.model.config import model_shape
from monorl.model.decoder import build_model
from monorl.train.losses import LossConfig
from monorl.train.packing import TrainSequence, make_micro_batches


@torch.no_grad()
def separately_packed_logprobs(trainer, model, seqs: Sequence[TrainSequence], temperature: float,
                               indices: Sequence[int] | None = None) -> list[list[float] | None]:
    """A frozen model's log-probs of each sequence's completion (of `seqs[indices]`; None for the others) as the
    trainer computed them before `monorl.train.frozen` (its `Trainer.frozen_logprobs`): the sequences packed a second
    time, a forward per pack, read to the host."""
    out: list[list[float] | None] = [None] * len(seqs)
    for mb in make_micro_batches(seqs, trainer.cfg.micro_batch_tokens, trainer.device, trainer.attn_backend,
                                 indices=indices, share_prompts=trainer.cfg.share_prompts):
        lp = trainer.response_logprobs(model, mb, temperature).tolist()
        pos = 0  # tokens are laid out sequence by sequence in index order within the micro-batch
        for i in sorted(set(mb.seq_ids.tolist())):
            n = len(seqs[i].completion_ids)
            out[i] = lp[pos:pos + n]
            pos += n
    return out


def _seqs() -> list[TrainSequence]:
    g = torch.Generator().manual_seed(0)
    return [TrainSequence(torch.randint(3, 60, (9,), generator=g).tolist(),
                          torch.randint(3, 60, (5 + i,), generator=g).tolist(), [-1.0] * (5 + i), float(i % 3 - 1),
                          group=i // 2) for i in range(6)]


def _trainer(with_reference: bool = True, **kw):
    from monorl.train.trainer import Trainer, TrainerConfig

    ref = build_model(model_shape("tiny"), "cpu", torch.float32, seed=1).eval().requires_grad_(False)
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=48, loss=LossConfig(kind="token_grpo", kl_coef=0.1), **kw)
    return Trainer(build_model(model_shape("tiny"), "cpu", torch.float32, seed=0), cfg, total_steps=2,
                   ref_model=ref if with_reference else None), ref


@pytest.mark.parametrize("share_prompts", [True, False])
def test_the_kl_reference_scores_the_students_own_packs_with_the_separate_forwards_values(share_prompts: bool) -> None:
    """The reference's log-probs on each of the step's packs are the values the separately packed forward gave
    (the same packs: both pack the step's sequences with the same budget, so the same kernels see the same rows, and
    the values agree exactly), and the loss graph's key is the same before they are filled (`_cover` keys a pack
    then) as after (`_ensure_graph`)."""
    from monorl.train.frozen import fill_frozen_logprobs

    trainer, ref = _trainer(share_prompts=share_prompts)
    seqs = _seqs()
    want = separately_packed_logprobs(trainer, ref, seqs, 0.7)
    mbs, _ = trainer._my_micro_batches(seqs)
    assert len(mbs) > 1 and all(mb.ref_logprobs is None for mb in mbs)  # several packs, none scored yet
    keys = [trainer._graph_key(mb, len(seqs), 0.7) for mb in mbs]
    fill_frozen_logprobs(trainer, ref, mbs, "ref_logprobs", 0.7)
    for mb, key in zip(mbs, keys, strict=True):
        assert mb.ref_logprobs.tolist() == [x for i in sorted(set(mb.seq_ids.tolist())) for x in want[i]]
        assert mb.teacher_logprobs is None
        assert trainer._graph_key(mb, len(seqs), 0.7) == key


def test_a_kl_step_packs_once_and_matches_the_separate_forwards_step(monkeypatch) -> None:
    """A step with a KL reference packs its sequences once (the reference scores the student's packs), and its loss,
    KL and update are those of the same step on sequences that bring the separately packed forward's log-probs (the
    old path's data: values equal, as the test above shows, so everything after is the same computation)."""
    import monorl.train.trainer as trainer_module

    new, ref = _trainer()
    old, _ = _trainer(with_reference=False)
    seqs = _seqs()
    with_ref = [TrainSequence(s.prompt_ids, s.completion_ids, s.old_logprobs, s.advantage, ref_logprobs=lp,
                              group=s.group) for s, lp in zip(seqs, separately_packed_logprobs(new, ref, seqs, 0.7),
                                                              strict=True)]
    packed = []
    real = trainer_module.make_micro_batches
    monkeypatch.setattr(trainer_module, "make_micro_batches", lambda *a, **k: packed.append(1) or real(*a, **k))
    row = new.step(seqs, 0.7)
    assert len(packed) == 1 and row["micro_batches"] > 1
    monkeypatch.setattr(trainer_module, "make_micro_batches", real)
    want = old.step(with_ref, 0.7)
    assert row["kl"] != 0.0
    for key in ("loss", "pg_loss", "kl", "logprob_diff_mean", "grad_norm"):
        assert row[key] == want[key], key
    for a, b in zip(new.model.parameters(), old.model.parameters(), strict=True):
        assert torch.equal(a, b)
