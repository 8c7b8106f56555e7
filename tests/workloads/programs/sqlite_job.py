"""A SQLite job, in its default (rollback journal) mode unless told: one open connection, a transaction per step."""

import sqlite3
import sys
import time

steps, pace = int(sys.argv[1]), int(sys.argv[2]) / 1000
mode = sys.argv[3] if len(sys.argv) > 3 else "delete"
db = sqlite3.connect("data.db")
if mode != "delete":
    db.execute(f"PRAGMA journal_mode={mode}")
assert db.execute("PRAGMA journal_mode").fetchone()[0] == mode
db.execute("CREATE TABLE IF NOT EXISTS item (id INTEGER PRIMARY KEY, step INTEGER, value INTEGER)")
with open("progress.log", "a") as progress:
    for step in range(steps):
        with db:
            db.executemany(
                "INSERT INTO item (step, value) VALUES (?, ?)", [(step, (step * 7919 + i) % 10007) for i in range(200)]
            )
            db.execute("UPDATE item SET value = (value * 31 + ?) % 10007 WHERE value % 5 = ?", (step, step % 5))
        progress.write(f"step {step}\n")
        progress.flush()
        time.sleep(pace)
with open("result.txt", "w") as result:
    for row in db.execute("SELECT step, count(*), sum(value), min(value), max(value) FROM item GROUP BY step"):
        result.write(" ".join(map(str, row)) + "\n")
db.close()
