"""Generation speed with jax's persistent compilation cache off and on (a check that loading or
writing cached executables does not slow the engine): the `bench_32k` engine of
`rl_step_realistic.py` generates 4 groups of 8 samples (340-token prompts, NEW new tokens) twice;
the second generate is timed. One process per setting:

    .venv/bin/python benchmarks/engine_generate_cache_ab.py off 32
    .venv/bin/python benchmarks/engine_generate_cache_ab.py /tmp/abcache 32   # twice: writes, then loads
"""

import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from rl_step_realistic import bench_config  # noqa: E402

from rlvr import api, compile_log  # noqa: E402
from rlvr.rollout.engine import Engine  # noqa: E402
from rlvr.rollout.types import Request, SamplingParams  # noqa: E402


def main() -> None:
    cache, new_tokens = sys.argv[1], int(sys.argv[2])
    compile_log.enable_cache("" if cache == "off" else cache, 1.0)
    model = api.build_model(bench_config(tempfile.mkdtemp(), 1, cache_dir=""))
    engine = Engine(model.cfg, model.params, max_slots=32, max_len=1024, page_size=16, decode_steps=16,
                    prefill_rows=4, prefill_chunk=256)
    rng = np.random.default_rng(0)

    def requests(tag):
        out = []
        for g in range(4):
            prompt = [int(x) for x in rng.integers(10, 32000, 340)]
            out += [Request(f"{tag}{g}-{k}", prompt, SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                                                                     sampling_seed=k)) for k in range(8)]
        return out
    t = time.perf_counter()
    engine.generate(requests("a"))
    t1 = time.perf_counter()
    engine.generate(requests("b"))
    t2 = time.perf_counter()
    print(f"cache={cache}: first {t1 - t:.1f}s second {t2 - t1:.1f}s cpu {time.process_time():.1f}", flush=True)


if __name__ == "__main__":
    main()
