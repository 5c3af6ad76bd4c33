"""Map stop 75's cut GPU kernel-test log (progress characters only) onto the collected test ids: the failed."""

import sys

log, order = sys.argv[1], sys.argv[2]
chars = []
for line in open(log).read().splitlines():
    chars += [c for c in line.split(" [")[0] if c in ".FsExX"]
ids = [x.strip() for x in open(order) if "::" in x]
print(f"# {len(chars)} results for {len(ids)} collected", file=sys.stderr)
for i, c in enumerate(chars):
    if c in "FE" and i < len(ids):
        print(ids[i])
