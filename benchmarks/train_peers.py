"""The training benchmark's PyTorch peers (benchmarks/train.py describes the benchmark): the same
model, parameters and batches as fusec's plan (``fusec.train.torch_model``), stepped four ways:

- ``eager_foreach``: eager forward/backward, ``AdamW(foreach=True)``;
- ``eager_fused``: the same with ``AdamW(fused=True)``;
- ``compile_fused``: the loss under ``torch.compile`` (inductor, static shapes), ``AdamW(fused=True)``;
- ``graph``: the whole step (forward, backward, clipping, ``AdamW(fused=True, capturable=True)``)
  captured once in a CUDA graph and replayed; its inputs are copied into static tensors first.

Every variant clips the gradients' global norm like fusec's plan; the speed runs use a constant
learning rate (the captured step cannot run a Python scheduler), the parity runs fusec's schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

VARIANTS = ("eager_foreach", "eager_fused", "compile_fused", "graph")


class TorchStepper:
    """``step(batch) -> loss tensor`` for one variant; batches are dicts of int64 CUDA tensors."""

    def __init__(self, variant: str, model: Any, params: Mapping[str, Any], opt: Any, device: str = "cuda",
                 bf16: bool = False):
        import torch

        from fusec.train import torch_model as TM

        self.torch, self.variant, self.opt, self.bf16 = torch, variant, opt, bf16
        self.module = TM.build(model, params, device)
        fused = variant != "eager_foreach" and device != "cpu"
        self.adam, self.sched = TM.optimizer(self.module, model, opt, fused=fused or None,
                                             foreach=(variant == "eager_foreach") or None, capturable=variant == "graph")
        self.loss_fn: Callable[[Mapping[str, Any]], Any] = self.module.loss
        if variant == "compile_fused":
            self.loss_fn = torch.compile(self.module.loss, dynamic=False)
        self.graph: Any = None
        self.static: dict[str, Any] = {}
        self.static_loss: Any = None
        self.device = device

    def _loss(self, batch: Mapping[str, Any]) -> Any:
        if self.bf16:
            with self.torch.autocast("cuda", dtype=self.torch.bfloat16):
                return self.loss_fn(batch)
        return self.loss_fn(batch)

    def _eager(self, batch: Mapping[str, Any]) -> Any:
        self.adam.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        loss.backward()
        if self.opt.max_grad_norm > 0:
            self.torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.opt.max_grad_norm, foreach=True)
        self.adam.step()
        if self.sched is not None:
            self.sched.step()
        return loss.detach()

    def capture(self, batch: Mapping[str, Any], warmup: int = 3) -> None:
        """The graph variant: ``warmup`` eager steps on a side stream, then one captured step; the
        parameters and AdamW's state are put back as they were before the warm-up, so the variant
        takes the same sequence of steps as the others."""
        torch = self.torch
        self.static = {k: v.clone() for k, v in batch.items()}
        saved = [p.detach().clone() for p in self.module.parameters()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._eager(self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.adam.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self._loss(self.static)
            self.static_loss.backward()
            if self.opt.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.opt.max_grad_norm, foreach=True)
            self.adam.step()
        with torch.no_grad():
            for p, v in zip(self.module.parameters(), saved):
                p.copy_(v)
            for st in self.adam.state.values():
                for t in st.values():
                    if torch.is_tensor(t):
                        t.zero_()

    def step(self, batch: Mapping[str, Any]) -> Any:
        if self.variant != "graph":
            return self._eager(batch)
        if self.graph is None:
            self.capture(batch)
        for k, v in batch.items():
            self.static[k].copy_(v, non_blocking=True)
        self.graph.replay()
        return self.static_loss

    def params(self) -> dict[str, Any]:
        return {n: p.detach().float().cpu().numpy() for n, p in zip(self.module.names, self.module.plist)}

    def predict(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        with self.torch.no_grad():
            if self.bf16:
                with self.torch.autocast("cuda", dtype=self.torch.bfloat16):
                    logits = self.module(batch["input_ids"], batch["attention_mask"])
            else:
                logits = self.module(batch["input_ids"], batch["attention_mask"])
        return {k: v.float().argmax(-1).cpu().numpy() for k, v in logits.items()}
