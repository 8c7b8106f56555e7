"""A job writing a SQLite database in its work dir, one row a step, in the journal mode given (delete or wal)."""

import sqlite3
import sys
import time

database = sqlite3.connect("rows.db", isolation_level=None)
database.execute(f"PRAGMA journal_mode={sys.argv[1]}")
database.execute("CREATE TABLE IF NOT EXISTS rows (step INTEGER)")
with open("progress.log", "a") as progress:
    for step in range(int(sys.argv[2])):
        database.execute("INSERT INTO rows VALUES (?)", (step,))
        count = database.execute("SELECT count(*) FROM rows").fetchone()[0]
        progress.write(f"step {step} rows {count}\n")
        progress.flush()
        time.sleep(float(sys.argv[3]))
