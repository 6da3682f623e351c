"""The same training models in PyTorch, for tests and ``benchmarks/train.py``: a module whose
parameters are fusec's (same names, shapes and initial values, HF's BERT arithmetic: post-LN,
erf GELU, additive finfo.min mask, no dropout) and an AdamW with fusec's schedule and clipping.
Imports torch when called; fusec itself never needs it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fusec.reference_train import lr_factor
from fusec.train.graphs import OptimConfig


def build(model: Any, params: Mapping[str, np.ndarray], device: str = "cpu") -> Any:
    """A torch.nn.Module computing ``model``'s logits per head and its loss (``module.loss``)."""
    import torch
    import torch.nn.functional as F

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.names = [s.name for s in model.specs]
            self.plist = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.tensor(np.asarray(params[n], np.float32), device=device)) for n in self.names])
            self.index = {n: i for i, n in enumerate(self.names)}

        def p(self, name: str) -> Any:
            return self.plist[self.index[name]]

        def linear(self, x: Any, prefix: str) -> Any:
            return F.linear(x, self.p(f"{prefix}.weight"), self.p(f"{prefix}.bias"))

        def ln(self, x: Any, prefix: str) -> Any:
            return F.layer_norm(x, x.shape[-1:], self.p(f"{prefix}.weight"), self.p(f"{prefix}.bias"), model.cfg.eps)

        def encoder(self, ids: Any, mask: Any, pre: str) -> Any:
            cfg = model.cfg
            bsz, seq = ids.shape
            x = self.p(f"{pre}embeddings.word_embeddings.weight")[ids] + self.p(f"{pre}embeddings.position_embeddings.weight")[:seq]
            if cfg.type_vocab_size:
                x = x + self.p(f"{pre}embeddings.token_type_embeddings.weight")[0]
            x = self.ln(x, f"{pre}embeddings.LayerNorm")
            add = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(torch.float32).min
            h, d = cfg.heads, cfg.hidden
            for i in range(cfg.layers):
                p = f"{pre}encoder.layer.{i}"

                def heads(t: Any) -> Any:
                    return t.view(bsz, seq, h, d // h).transpose(1, 2)
                q, k, v = (heads(self.linear(x, f"{p}.attention.self.{n}")) for n in ("query", "key", "value"))
                s = torch.matmul(q, k.transpose(-1, -2)).float() * (d // h) ** -0.5 + add
                ctx = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v).transpose(1, 2).reshape(bsz, seq, d)
                x = self.ln(x + self.linear(ctx, f"{p}.attention.output.dense").float(), f"{p}.attention.output.LayerNorm")
                f = self.linear(F.gelu(self.linear(x, f"{p}.intermediate.dense")), f"{p}.output.dense")
                x = self.ln(x + f.float(), f"{p}.output.LayerNorm")
            return x

        def forward(self, input_ids: Any, attention_mask: Any) -> dict[str, Any]:
            if model.kind == "intent-slot":
                x = self.encoder(input_ids, attention_mask, "")
                return {"intent_labels": self.linear(x[:, 0], "intent_classifier"),
                        "slot_labels": self.linear(x, "slot_classifier")}
            x = self.encoder(input_ids, attention_mask, "bert.")
            pooled = torch.tanh(self.linear(x[:, 0], "bert.pooler.dense"))
            return {"labels": self.linear(pooled, "classifier")}

        def loss(self, batch: Mapping[str, Any]) -> Any:
            logits = self(batch["input_ids"], batch["attention_mask"])
            total = 0
            for lab in model.labels:
                z = logits[lab.name].float()
                total = total + F.cross_entropy(z.reshape(-1, z.shape[-1]), batch[lab.name].reshape(-1), ignore_index=-100)
            return total

    return Module()


def optimizer(module: Any, model: Any, opt: OptimConfig, fused: bool | None = None, foreach: bool | None = None,
              capturable: bool = False) -> tuple[Any, Any]:
    """(AdamW, LambdaLR) with fusec's decay groups and schedule (step t uses lr * lr_factor(t));
    ``capturable`` (a step captured in a CUDA graph): a constant learning rate, no scheduler."""
    import torch

    decay = [p for s, p in zip(model.specs, module.plist) if s.decay]
    plain = [p for s, p in zip(model.specs, module.plist) if not s.decay]
    lr = torch.tensor(opt.lr, device=decay[0].device) if capturable else opt.lr
    adam = torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay}, {"params": plain, "weight_decay": 0.0}],
                             lr=lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, fused=fused, foreach=foreach,
                             capturable=capturable)
    if capturable:  # a tensor learning rate the CUDA graph reads; the schedule would replace it: none
        return adam, None
    attrs = opt.attrs(tuple(s.decay for s in model.specs))
    sched = torch.optim.lr_scheduler.LambdaLR(adam, lambda e: lr_factor(attrs, e + 1))
    return adam, sched


def train_step(module: Any, adam: Any, sched: Any, batch: Mapping[str, Any], opt: OptimConfig) -> Any:
    """Forward, backward, clipping, AdamW, schedule; returns the loss tensor (not synchronized)."""
    import torch

    adam.zero_grad(set_to_none=True)
    loss = module.loss(batch)
    loss.backward()
    if opt.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(module.parameters(), opt.max_grad_norm)
    adam.step()
    if sched is not None:
        sched.step()
    return loss

