"""transformers' Trainer on an hplan plan: trace the Trainer's own step, plan it, add HplanCallback, train.

Run it: `python examples/trainer.py` (a tiny GPT-2 from its config, random weights, nothing downloaded; CPU, well
under a minute). On a machine without a GPU the fast tier is host memory, as in examples/own_loop.py, so the
script runs where it is shown; with a GPU it plans for the memory that GPU has free (unverified in hplan's CI).
"""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hplan.integrations.trainer import HplanCallback, trace_trainer
from hplan.planner import make_hardware, make_plan, min_gpu_bytes, trace_slack

model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64))  # yours
ids = torch.randint(512, (64, 32), generator=torch.Generator().manual_seed(0))
train_data = [{"input_ids": row, "labels": row} for row in ids]                 # your dataset
args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=6, per_device_train_batch_size=4,
                         learning_rate=1e-3, max_grad_norm=1.0, report_to=[], logging_steps=2,
                         use_cpu=not torch.cuda.is_available())

trainer = Trainer(model=model, args=args, train_dataset=train_data)   # your TrainingArguments, unchanged
trace = trace_trainer(trainer)              # the Trainer's own step: its batches, loss, param groups, accumulation
if args.device.type == "cuda":              # a GPU of yours: plan for what it has, or name one ("rtx3090", ...)
    hardware = make_hardware("rtx3090", gpu_bytes=torch.cuda.mem_get_info()[0], **trace_slack(trace))
else:                                       # the CPU stands in for the GPU: a fast tier of a third of the model
    floor = min_gpu_bytes(trace).gpu_bytes
    hardware = make_hardware("cpu", gpu_bytes=floor + trace.model_bytes // 3, **trace_slack(trace))
plan = make_plan(trace, hardware)
callback = HplanCallback(plan)
trainer.add_callback(callback)              # optimizer steps run on the plan; saving and evaluation outside it
trainer.train()
print(f"{callback.steps} steps on the plan, peak {callback.peak_resident_bytes} B of a {plan.gpu_bytes} B budget")
