"""The two small programs ``tfcs-run`` puts between itself and a worker (standard library only; each runs
with ``python -S -E -c``).

``DEATH_SIGNAL``: runs between fork and the worker's program (Linux) so that the worker gets SIGTERM when
its parent dies, even by SIGKILL, and no worker trains on alone; then a plain exec, so the worker's pid,
environment and arguments are its own. Arguments: the parent's pid, then the worker's command.

``REMOTE``: what ``tfcs-run`` starts on another host over ssh. Its first line of standard input is the
worker's spec, JSON ``{"argv", "env", "cwd", "grace"}``, so the job's token and environment never
appear on a command line; every later line is a signal number it sends to the worker's process group.
When standard input ends (``tfcs-run`` or its ssh connection is gone) the worker gets SIGTERM, then
SIGKILL ``grace`` seconds later. When the worker exits, whatever it left in its process group is stopped
the same way, and the program exits with the worker's code (128 + signal when it was killed), which
ssh passes back.
"""

DEATH_SIGNAL = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before the line above
    sys.exit(128 + int(signal.SIGTERM))
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    sys.stderr.write(f"tfcs-run: cannot start {sys.argv[2]!r}: {e}\\n")
    sys.exit(127)
"""

REMOTE = """\
import json, os, signal, socket, subprocess, sys, threading, time
spec = json.loads(sys.stdin.readline())
where = socket.gethostname()
try:
    os.chdir(spec["cwd"])
except OSError as e:
    sys.stderr.write(f"tfcs-run: on host {where}: cannot enter {spec['cwd']!r}: {e}\\n")
    sys.exit(1)
try:
    child = subprocess.Popen([sys.executable, "-S", "-E", "-c", spec["death_shim"], str(os.getpid())]
                             + spec["argv"], env=spec["env"], stdin=subprocess.DEVNULL, start_new_session=True)
except OSError as e:
    sys.stderr.write(f"tfcs-run: on host {where}: cannot start {spec['argv'][0]!r}: {e}\\n")
    sys.exit(127)

def send(sig):
    try:
        os.killpg(child.pid, sig)
        return True
    except OSError:
        return False

def stop_group():
    send(signal.SIGTERM); send(signal.SIGCONT)
    end = time.monotonic() + spec["grace"]
    while time.monotonic() < end and send(0):
        time.sleep(0.05)
    send(signal.SIGKILL)

def control():
    for line in sys.stdin:
        if line.strip().isdigit():
            send(int(line))
    stop_group()

threading.Thread(target=control, daemon=True).start()
code = child.wait()
stop_group()
sys.exit(128 - code if code < 0 else code)
"""
