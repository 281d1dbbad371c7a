"""Suite-wide settings.

One torch thread per test process: `make test` runs two xdist workers on two cores, and a
2-thread forward whose second core is busy can be 10x slower than a 1-thread one.
"""

import torch

torch.set_num_threads(1)
