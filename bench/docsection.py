"""One generated section of docs/benchmarks.md, between a benchmark's begin and end markers.

    import docsection
    docsection.write("docs/benchmarks.md", BEGIN, END, text, after="<!-- engine-bench:end -->")

Replaces what lies between the markers (the text's own heading above them stays where the
document has it). A document without them gets the section from `insert(doc, text)` (a new
document, or None to fall through), else after the `after` marker, else at the end. The file is
written whole and renamed into place. Stdlib only.
"""

import os


def write(path, begin_marker, end_marker, text, after=None, insert=None):
    doc = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    begin = begin_marker.split(" (")[0]
    if begin in doc and end_marker in doc and doc.index(begin) < doc.index(end_marker):
        start = doc.index(begin)
        end = doc.index(end_marker) + len(end_marker)
        inner = text[text.index(begin):text.index(end_marker) + len(end_marker)]
        doc = doc[:start] + inner + doc[end:]
    elif insert is not None and insert(doc, text) is not None:
        doc = insert(doc, text)
    elif after is not None and after in doc:
        at = doc.index(after) + len(after)
        doc = doc[:at] + "\n\n" + text.rstrip("\n") + "\n" + doc[at:]
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(doc.rstrip("\n") + "\n")
    os.replace(tmp, path)
