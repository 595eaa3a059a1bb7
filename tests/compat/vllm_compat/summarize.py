"""One line per failed test: the first 'E ' lines of its report (``run.sh ... > log``)."""

import re
import sys

text = open(sys.argv[1]).read()
blocks = re.split(r"\n_{3,} (test_\S+(?: \S+)?) _{3,}\n", text)
for name, body in zip(blocks[1::2], blocks[2::2], strict=False):
    errors = [line[2:].strip() for line in body.splitlines() if line.startswith("E ")]
    print(f"{name[:75]:75s} | {' '.join(errors[:2])[:230]}")
