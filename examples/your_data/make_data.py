"""Write qa.jsonl: 2000 arithmetic questions with their answers, one JSON object a line.

    python make_data.py            # writes qa.jsonl next to this file
    python make_data.py out.jsonl  # or there
"""

import json
import os
import random
import sys
from pathlib import Path

path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("qa.jsonl")
questions = [(a, op, b) for a in range(50) for op in "+-" for b in range(20)]  # each one once
random.Random(0).shuffle(questions)
with open(path, "w") as f:
    for i, (a, op, b) in enumerate(questions):
        answer = a + b if op == "+" else a - b
        f.write(json.dumps({"id": i, "question": f"What is {a} {op} {b}?", "answer": str(answer)}) + "\n")
print(f"wrote {len(questions)} rows to {os.path.relpath(path)}")
