"""Every step of the method once on `--device` (default cuda), on the tiny GPT-2 fixture: a forward
pass, DoF sampling, one distillation step of each loss and one direct step, a student built by the
public replace_attention, and a prefill with recurrent decoding. tests/test_gpu.py runs it under
../shared/tools/simcuda_run.py, which checks every op against CUDA's device rules."""

import copy
import sys
from pathlib import Path

import torch

from dofmini import dof, hub
from dofmini.distill import TrainSettings, distill, train_direct
from dofmini.generate import generate
from dofmini.students import make_student, replace_attention

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
teacher = hub.load(Path(__file__).parent / "fixtures" / "gpt2-tiny").to(device)
tokens = torch.randint(0, teacher.config.vocab_size, (400,), generator=torch.Generator())
logits = teacher(tokens[:64].view(2, 32).to(device))  # [2, 32, V]
assert logits.device.type == torch.device(device).type
queries_keys = dof.sample_queries_keys(teacher, tokens, J=64, ctx=32)  # [L, H, J, d]
settings = TrainSettings(steps=1, batch=2, ctx=32, log_every=1)
dims = [8] * teacher.config.n_layer
for loss in ("softmax", "l2"):
    distill(teacher, dims, tokens, settings, loss=loss, log=lambda _: None)
train_direct(make_student(teacher, "prf", dims, 0), tokens, settings, log=lambda _: None)
student = replace_attention(copy.deepcopy(teacher), dims, seed=0)
placed = {p.device.type for p in student.parameters()}
assert placed == {torch.device(device).type}, f"replace_attention left parameters on {placed}"
generated = generate(student, tokens[:16].tolist(), 8)  # a prefill, then 8 recurrent steps
assert len(generated) == 24
print("every step ran on", device)
