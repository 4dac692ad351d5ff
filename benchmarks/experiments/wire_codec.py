"""Wire codec: what decoding a lookup request and encoding / decoding its reply costs, in us.

    python benchmarks/experiments/wire_codec.py [--iters 200000]

The daemon decodes every request once into its declared type (client/shared/messages.py) and encodes
every reply from one; this times those three steps alone (no socket), to keep the typed wire's
cost in view beside the ~300 us the transport takes (benchmarks/service_overhead.py).
"""

from __future__ import annotations

import argparse
import timeit

from engramd.client.shared import protocol
from engramd.client.shared.messages import LookupReply

LOOKUP = dict(client_id=3, slot=1, seq=9, ids_dtype="int32", ids_shape=[2, 2, 24], inline=True,
              ack=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200_000)
    n = parser.parse_args().iters
    request = protocol.encode_request("lookup", 41, [b"\0" * 384], **LOOKUP)
    reply = protocol.encode_reply(41, "e" * 16, LookupReply(1, 9, 0))
    steps = {
        "decode_request (lookup)": lambda: protocol.decode_request(request),
        "encode_reply (lookup)": lambda: protocol.encode_reply(41, "e" * 16, LookupReply(1, 9, 0)),
        "decode_reply (lookup)": lambda: protocol.decode_reply(reply),
    }
    for name, step in steps.items():
        print(f"{name}: {timeit.timeit(step, number=n) / n * 1e6:.2f} us")


if __name__ == "__main__":
    main()
