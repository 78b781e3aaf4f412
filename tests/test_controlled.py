"""The controlled experiment's virtual layers: one real layer's queries and keys at known
temperatures, which distillation, the error measure and DoF read like any teacher's layers."""

import importlib.util

import torch
from conftest import REPO

from dofmini import dof
from dofmini.distill import TrainSettings, distill
from dofmini.study.evaluate import layer_errors

# The experiment's script lives with its results, outside the package.
SCRIPT = REPO / "runs" / "standin-gpt2-controlled" / "controlled.py"
_spec = importlib.util.spec_from_file_location("controlled", SCRIPT)
controlled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(controlled)
VirtualTeacher = controlled.VirtualTeacher

TEMPERATURES = (0.5, 1.0, 2.0)


def test_virtual_layers_scale_one_real_layer_and_order_dof(tiny, tiny_ids):
    virtual = VirtualTeacher(tiny, 1, TEMPERATURES)
    ids = tiny_ids[:64].view(2, 32)
    (_, (q, k, v)), layers = tiny.capture(ids), virtual.capture(ids)
    assert len(layers) == len(TEMPERATURES) == virtual.config.n_layer
    for s, (q_s, k_s, v_s) in zip(TEMPERATURES, layers):
        logits, scaled = q @ k.mT, q_s @ k_s.mT  # [B, H, T, T]
        assert torch.allclose(scaled, s * logits, rtol=1e-5, atol=1e-5) and torch.equal(v_s, v)
    layer_dof = dof.estimate_dof(virtual, tiny_ids, 2**-4, J=128, ctx=32).amax(-1)  # [3]
    assert layer_dof[0] < layer_dof[1] < layer_dof[2]  # sharper attention, more DoF


def test_a_student_of_virtual_layers_trains_and_is_measured(tiny, tiny_ids):
    virtual = VirtualTeacher(tiny, 0, TEMPERATURES)
    settings = TrainSettings(steps=2, batch=2, ctx=32)
    student, _ = distill(virtual, [4, 4, 4], tiny_ids, settings, log=lambda line: None)
    errors = layer_errors(virtual, student, tiny_ids, 32, 2)
    assert len(errors["kl"]) == 3 and all(e > 0 for e in errors["kl"])
    assert student.identity == f"{tiny.identity}/layer 0 at 0.5,1.0,2.0"
