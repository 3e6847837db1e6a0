"""A KernelBench-format attention problem and a solution, checked by fa_verify.

    fa_verify check examples/kernelbench_attention.py --max-examples 10

`Model` is the reference (torch's scaled_dot_product_attention); `ModelNew` is the solution
being checked (here attention written out with explicit torch ops, in float32, rounded to the
input dtype once). fa_verify infers from `Model`, by calling it on probe tensors, what ModelNew
must compute: layout [B, H, N, D], scale 1/sqrt(D), not causal, dtype fp16 (get_inputs), and
checks ModelNew against its certified oracle under those conventions.
"""

import torch
import torch.nn.functional as F

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 128, 64


class Model(torch.nn.Module):
    def forward(self, Q, K, V):
        return F.scaled_dot_product_attention(Q, K, V)


class ModelNew(torch.nn.Module):
    def forward(self, Q, K, V):
        scores = Q.float() @ K.float().transpose(-1, -2) / Q.shape[-1] ** 0.5
        weights = torch.softmax(scores, dim=-1)
        return (weights @ V.float()).to(Q.dtype)


def get_inputs():
    return [torch.rand(BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.float16) for _ in range(3)]


def get_init_inputs():
    return []
