"""Writes questions.jsonl: divisions to give to a number of decimal places, graded within a tolerance (a task
no built-in grader handles: 5.666 is right for "to two decimal places" only if it is within 0.005 of 17 / 3).

    python examples/tolerance/make_questions.py      # 240 rows, the same every time
"""

import json
import random
from pathlib import Path

draw = random.Random(75)
rows = []
for _ in range(240):
    a, b, places = draw.randint(10, 99), draw.randint(2, 9), draw.choice([1, 2])
    rows.append({"question": f"What is {a} / {b}, to {places} decimal place{'s' * (places > 1)}?",
                 "answer": round(a / b, places), "tolerance": 0.5 * 10 ** -places, "places": places})
out = Path(__file__).with_name("questions.jsonl")
out.write_text("".join(json.dumps(row) + "\n" for row in rows))
print(f"wrote {len(rows)} rows to {out}")
