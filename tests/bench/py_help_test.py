"""py_help_test.py SCRIPT [FLAG...]: SCRIPT --help exits 0, and every option that takes a value
says its default in its help ("default"), except the FLAGs given (required ones, or ones whose
absence is the meaning, like --api-key). The Python programs' counterpart of help_test.sh."""
import re
import subprocess
import sys

script, exempt = sys.argv[1], set(sys.argv[2:])
run = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                     env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"})
if run.returncode != 0:
    sys.exit(f"{script} --help exited {run.returncode}: {run.stderr}")
options = run.stdout.split("options:", 1)[-1]
# One entry per option: its line "  --name METAVAR  help..." and the indented lines that follow.
entries = re.split(r"\n(?=  -)", options)
missing = []
for entry in entries:
    m = re.match(r"\s*(?:-\w, )?(--[\w-]+)( [A-Z_]+)?", entry)
    if not m or m.group(1) == "--help" or not m.group(2) or m.group(1) in exempt:
        continue  # a switch (no value) has no default to say
    if "default" not in entry:
        missing.append(m.group(1))
if missing:
    sys.exit(f"{script} --help does not say the default of: {', '.join(missing)}")
print(f"ok: {script}")
