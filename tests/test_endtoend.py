"""The end-to-end KL against a direct computation, and the one-layer swap, on the tiny fixture;
its summary over seeds against the stats helpers."""

import torch

from dofmini.model import Attention
from dofmini.students import make_student
from dofmini.study.compare import e2e_summary
from dofmini.study.endtoend import e2e_kl, swapped
from dofmini.study.stats import mean_ci, paired_diff


def by_hand(teacher, model, windows):  # [W, ctx] -> mean over tokens of KL(p_teacher ‖ p_model)
    with torch.no_grad():
        log_p = teacher(windows).double().log_softmax(-1)  # [W, ctx, V]
        log_q = model(windows).double().log_softmax(-1)  # [W, ctx, V]
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def test_e2e_kl_is_the_mean_token_kl_computed_directly(tiny):
    ctx, vocab = 16, tiny.config.vocab_size
    ids = torch.randint(0, vocab, (7 * ctx,), generator=torch.Generator().manual_seed(0))  # [7ctx]
    student = make_student(tiny, "prf", [4, 8], feature_seed=3)
    # windows 2..6 (offset 2), in batches of 2 so the last batch is partial
    found = e2e_kl(tiny, [student, tiny], ids, ctx, windows=5, offset=2, batch=2)
    expected = by_hand(tiny, student, ids[2 * ctx :].view(5, ctx))
    assert expected > 1e-4  # an untrained draw is visibly off the teacher
    assert abs(found[0] - expected) < 1e-6
    assert abs(found[1]) < 1e-6  # the teacher against itself


def test_one_layer_swap_changes_only_that_layer(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 16), generator=torch.Generator())  # [2, 16]
    student = make_student(tiny, "prf", [4, 8], feature_seed=0)
    with torch.no_grad():
        teacher_logits, teacher_qkv = tiny(ids), []  # [2, 16, V]
        tiny(ids, capture=teacher_qkv)
    for layer in range(tiny.config.n_layer):
        model, qkv = swapped(tiny, student, layer), []
        with torch.no_grad():
            logits = model(ids, capture=qkv)  # [2, 16, V]
        assert model.blocks[layer] is student.blocks[layer]
        for i, block in enumerate(model.blocks):
            if i != layer:  # the teacher's own block, attention included
                assert block is tiny.blocks[i] and type(block.attn) is Attention
        # layers up to the swapped one see exactly the teacher's inputs
        for i in range(layer + 1):
            for mine, theirs in zip(qkv[i], teacher_qkv[i]):
                assert torch.equal(mine, theirs)
        assert not torch.allclose(logits, teacher_logits)
    # the teacher is left as it was
    assert all(type(block.attn) is Attention for block in tiny.blocks)
    with torch.no_grad():
        assert torch.equal(tiny(ids), teacher_logits)


def test_e2e_summary_is_the_t_interval_and_the_paired_difference_against_fix():
    errors = {"kl": [0.1, 0.2], "output_rel": [0.3, 0.4], "kernel_l2": [0.5, 0.6]}

    def student(e2e):
        return dict(e2e_kl=e2e, layer_error=errors, wikitext2_ppl=10.0, heldout_ppl=11.0)

    fix = {0: student(1.0), 1: student(2.0), 2: student(4.0)}
    dof = {0: student(1.5), 1: student(2.0), 2: student(5.0)}
    found = e2e_summary({("fix", "softmax", 16): fix, ("dof", "softmax", 16): dof})
    assert found["dof/softmax/b16"]["seeds"] == [0, 1, 2]
    assert found["dof/softmax/b16"]["e2e_kl"] == list(mean_ci([1.5, 2.0, 5.0]))
    assert found["dof/softmax/b16"]["minus_fix"] == list(paired_diff([1.5, 2.0, 5.0], [1, 2, 4]))
    assert found["dof/softmax/b16"]["relative"] == (8.5 / 3) / (7 / 3) - 1
    one_seed = e2e_summary({("fix", "softmax", 8): {0: student(1.0)}})["fix/softmax/b8"]
    assert one_seed["e2e_kl"] == [1.0, None] and one_seed["minus_fix"] == [0.0, None]
