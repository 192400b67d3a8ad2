"""Part `fp8lib`: the FP8 implementation chosen by measurement (fp8_lib.py): one drafter MLP at the
target's widths over a chunk's block tokens, forward + backward compiled, bf16 against dfpipe's fp8
against torchao's Float8Linear (rowwise), where torchao works with this torch. Result: figures `fp8lib`."""
from __future__ import annotations

import json

from bench.gpu.shared import Ctx, SkipPart, target_shape


def part_fp8lib(ctx: Ctx) -> str:
    from bench.gpu.fp8_lib import compare
    from drafter_trainer.fp8 import fp8_supported
    from drafter_trainer.loss import AUTO_CHUNK_ROWS

    if not ctx.cuda or not fp8_supported(ctx.device.index or 0):
        raise SkipPart("needs a GPU with FP8 tensor cores")
    shape = target_shape(ctx.args)
    numbers = compare(shape.hidden, shape.intermediate, AUTO_CHUNK_ROWS)
    ctx.store.figures("fp8lib", **numbers)
    print(json.dumps(numbers, indent=1), flush=True)
    return "measured"
