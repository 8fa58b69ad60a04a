"""The seed lab's MLP (768-3072-768, bf16 parameters, batch 32) graphed with fp8ext.make_graphed_callables in a fresh
process, next to the same model eager (development aid: does capture work, do the losses agree).

    python benchmarks/dev/graph_lab.py
"""
import torch
import torch.nn.functional as F
from torch import nn

import fp8ext


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = fp8ext.Linear(768, 3072, device="cuda", params_dtype=torch.bfloat16)
        self.fc2 = fp8ext.Linear(3072, 768, device="cuda", params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def losses(graphed, steps=20):
    torch.manual_seed(0)
    model = MLP()
    recipe = fp8ext.DelayedScaling(amax_history_len=16, backoff_factor=0.5 if graphed else 0.25)
    x = torch.randn(32, 768, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(32, 768, device="cuda", dtype=torch.bfloat16)
    fwd = fp8ext.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=recipe) if graphed else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        if graphed:
            loss = F.mse_loss(fwd(x), target)
        else:
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                loss = F.mse_loss(fwd(x), target)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


if __name__ == "__main__":
    e = losses(False)
    g = losses(True)
    print("eager  ", [f"{v:.5f}" for v in e[:5]], "...", f"{e[-1]:.5f}")
    print("graphed", [f"{v:.5f}" for v in g[:5]], "...", f"{g[-1]:.5f}")
    print("bit-equal losses:", e == g)
