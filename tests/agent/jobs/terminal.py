"""A job that takes a controlling terminal (which CRIU cannot checkpoint without --shell-job)."""

import fcntl
import os
import termios
import time

os.setsid()
leader, follower = os.openpty()
fcntl.ioctl(follower, termios.TIOCSCTTY, 0)
open("ready", "w").close()
time.sleep(60)
