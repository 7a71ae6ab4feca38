"""`python -m rlvr.explore WORKDIR [WORKDIR ...] --port=8008`: serves the run explorer."""

from __future__ import annotations

import argparse
import os
import sys

from rlvr.explore.server import make_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlvr.explore", description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+", help="rlvr workdirs (RL, evaluate or SFT runs)")
    parser.add_argument("--port", type=int, default=8008, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1",
                        help="0.0.0.0 serves other machines (no authentication: trusted networks only)")
    args = parser.parse_args(argv)
    missing = [w for w in args.workdirs if not os.path.isdir(w)]
    if missing:
        print(f"not a directory: {', '.join(missing)} (give rlvr workdirs)", file=sys.stderr)
        return 2
    server = make_server(args.workdirs, args.port, args.host)
    host, port = server.server_address[:2]
    print(f"run explorer on http://{host}:{port}/ over {len(args.workdirs)} run(s); Ctrl-C stops it", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
