#!/usr/bin/env python
"""Write the embedded English->Romanian number data set (no network).

Usage (from the repository root):

    python scripts/make_demo_data.py --out_dir data/demo

Options: --n_train 20000 --n_val 500 --n_test 1000 --seed 0 --max_number 999999
"""

import sys

from trainer_shard.demo import make_demo_data_main

if __name__ == "__main__":
    sys.exit(make_demo_data_main())
