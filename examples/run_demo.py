"""`make demo`: runs examples/quickstart.ipynb headless through a real Jupyter kernel, printing each
cell's output to the terminal as it completes, and saves the executed notebook."""

import os
import re
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

HERE = os.path.dirname(os.path.abspath(__file__))
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def show(cell, index):
    if cell.cell_type != "code":
        return
    print(f"\n\033[1mIn [{cell.get('execution_count') or index}]:\033[0m " + cell.source.replace("\n", "\n        "))
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            sys.stdout.write(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/plain" in data:
                print(data["text/plain"])
            else:
                print(f"<{', '.join(data)}>")
        elif out.output_type == "error":
            print("\n".join(out.traceback))
    sys.stdout.flush()


def main(name="quickstart.ipynb"):
    path = os.path.join(HERE, name)
    nb = nbformat.read(path, as_version=4)
    started = time.monotonic()
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": HERE}})
    client.on_cell_executed = lambda cell, cell_index, execute_reply: show(cell, cell_index)
    failed = False
    try:
        client.execute()
    except CellExecutionError:
        failed = True
    out_path = os.path.join(HERE, name.replace(".ipynb", ".out.ipynb"))
    nbformat.write(nb, out_path)
    status = "FAILED" if failed else "done"
    print(f"\n{name}: {status} in {time.monotonic() - started:.1f} s; executed notebook saved to {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
