"""Our FlashAttention-2 backward kernel (kernels/fa2_bwd.cu) as backends of backward problems.

`fa2-bwd-cpu` runs it on the CUDA-on-CPU runner, `fa2-bwd-pycuda` through PyCUDA (a GPU, or the
fake driver); `fa2-bwd-det-cpu` in its deterministic mode (dQ without atomics, declared: its dq
must then be bitwise reproducible). The precision model is FA2's backward (P and dS rounded to
the input dtype, fp32 accumulation). On the CPU runner it offers the race detector's and
AddressSanitizer's builds to the `races` and `address_sanitizer` properties; `source` runs a
mutated copy (fa_verify.judge.mutants), everything else unchanged.
"""

from __future__ import annotations

from fa_verify.backends.base import Backend
from fa_verify.kernels import backward as kernel
from fa_verify.limits import Limits
from fa_verify.precision import PrecisionModel


class BackwardKernelBackend(Backend):
    """fa2_bwd.cu on `runner` ("cpu" or "pycuda"), `deterministic` or not; `source`: the text to
    compile instead (a mutant's), then named `name`; `sanitize`: its AddressSanitizer build."""

    kinds = ("backward",)
    dtypes = kernel.DTYPES
    features = kernel.FEATURES
    #: the head dims it has entries for: edge cases move to them, draws stay within them
    limits = Limits(head_dims=tuple(kernel.CONFIGS))

    def __init__(self, runner: str = "cpu", deterministic: bool = False, source: str | None = None,
                 name: str | None = None, sanitize: bool = False):
        self.runner, self.deterministic_dq, self.source, self.sanitize = runner, deterministic, source, sanitize
        self.name = (name or f"{kernel.LABEL}{'-det' if deterministic else ''}-{runner}") + ("-asan" if sanitize else "")

    def precision(self, dtype) -> PrecisionModel:
        return PrecisionModel.flash(dtype)

    def availability(self):
        if self.runner == "cpu":
            from fa_verify.backends.cuda_kernels import cpu_runner_availability

            return cpu_runner_availability()
        from fa_verify.kernels.pycuda_runner import pycuda_availability

        return pycuda_availability()

    def supports(self, problem) -> str | None:
        return super().supports(problem) or kernel.supports(problem.forward)

    def build(self):
        """Build (or fetch) the CPU runner's module of the kernel this backend launches."""
        return self._module()

    def _module(self, racecheck: bool = False):
        from fa_verify.backends.cuda_kernels import cpu_module

        return cpu_module(kernel.cpu_kernel(self.source), sanitize=self.sanitize and not racecheck, racecheck=racecheck)

    def _run(self, problem):
        if self.runner == "cpu":
            the_plan = kernel.plan(problem.forward, problem.out, problem.lse, problem.dout,
                                   deterministic=self.deterministic_dq)
            kernel.run_plan_on_cpu(the_plan, self._module())
            dq, dk, dv, dsinks = kernel.gradients(the_plan, problem.forward)
        else:
            dq, dk, dv, dsinks = kernel.run_fa2_backward(problem.forward, problem.out, problem.lse, problem.dout,
                                                         runner=self.runner, deterministic=self.deterministic_dq,
                                                         source=self.source)
        return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)

    # --- the CPU runner's hooks (races, address_sanitizer) ----------------------------------------
    def run_racecheck(self, problem) -> None:
        """`races`' hook: the problem on the race detector's build; KernelRaceError for a race."""
        the_plan = kernel.plan(problem.forward, problem.out, problem.lse, problem.dout,
                               deterministic=self.deterministic_dq)
        kernel.run_plan_on_cpu(the_plan, self._module(racecheck=True))

    def sanitized(self) -> "BackwardKernelBackend":
        """The same kernel built with AddressSanitizer (the address_sanitizer property's twin)."""
        if self.sanitize:
            return self
        return BackwardKernelBackend(self.runner, self.deterministic_dq, self.source, self.name, sanitize=True)


def backward_kernel_backends() -> list[Backend]:
    """fa2-bwd-cpu, fa2-bwd-det-cpu, fa2-bwd-pycuda."""
    return [BackwardKernelBackend("cpu"), BackwardKernelBackend("cpu", deterministic=True),
            BackwardKernelBackend("pycuda")]
