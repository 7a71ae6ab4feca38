"""`python -m fleet_fake_server --hf_dir=X --host H --port P`: a FakeEngine (rollout_fakes) behind the
SGLang-protocol server, as `rlvr.rollout.server` would run, for the fleet command's tests (no model,
no compiling). Stops on SIGTERM."""

import argparse
import signal
import threading

from rollout_fakes import start_server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf_dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    handle = start_server(port=args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    handle.stop()


if __name__ == "__main__":
    main()
