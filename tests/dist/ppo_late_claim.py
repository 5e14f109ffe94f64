"""`-m minirl.ppo` whose train rank 0 claims the run directory 3 s late, as one whose preflight reads a large
dataset over a slow file system would. A rank that does not wait for the claim (refit.share_claim) writes into
the run directory before it, and --log.overwrite then removes what it wrote. Run with torchrun like
`-m minirl.ppo`, with its flags."""

import sys
import time

from minirl import launch, ppo

claim = launch.claim


def late(*args, **kwargs):
    time.sleep(3)
    return claim(*args, **kwargs)


launch.claim = late
ppo.cli(sys.argv[1:])
