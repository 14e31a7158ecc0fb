"""Writes a dictd dictionary (Debian's dict-* packages) as JSON lines, one entry per document.

The sample datasets come from public-domain dictionaries that Debian ships in dictd format:
an .index file (headword, base64 offset, base64 length per line) and a gzip'd .dict.dz body.
Each entry becomes {"text": ...}: the headword line, then its paragraphs with the dictd
indentation removed and prose lines re-joined; verse and code blocks keep their line breaks.

    apt-get install -y dict-jargon
    python tools/build_sample_text.py --dict /usr/share/dictd/jargon --output datasets_gpt/dataset.json
"""

import argparse
import gzip
import json
import logging
import re
import sys
import textwrap

logger = logging.getLogger("build_sample_text")

DICTD_BASE64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
CROSS_REFERENCE = re.compile(r"\{\s*([^{}]*?)\s*\}", re.DOTALL)


def decode_dictd_number(text: str) -> int:
    value = 0
    for char in text:
        value = value * 64 + DICTD_BASE64.index(char)
    return value


def read_entries(dict_prefix: str) -> list[tuple[str, str]]:
    """(headword, raw entry text) in file order, without the dictd 00-database-* headers."""
    with gzip.open(dict_prefix + ".dict.dz", "rb") as handle:
        body = handle.read()
    spans = []
    with open(dict_prefix + ".index", encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 3:
                raise ValueError(f"{dict_prefix}.index:{line_number}: expected 3 tab-separated fields")
            headword, offset, length = fields[:3]
            if headword.startswith("00database") or headword.startswith("00-database"):
                continue
            spans.append((decode_dictd_number(offset), decode_dictd_number(length), headword))
    # The index is sorted by headword and may list one entry under several headwords.
    unique_spans = sorted({(offset, length): headword for offset, length, headword in spans}.items())
    return [
        (headword, body[offset : offset + length].decode("utf-8"))
        for (offset, length), headword in unique_spans
    ]


def entry_to_text(raw: str) -> str:
    """The entry as plain prose: paragraphs separated by a blank line."""
    raw = CROSS_REFERENCE.sub(r"\1", raw)
    paragraphs = []
    for block in re.split(r"\n\s*\n", raw.strip("\n")):
        lines = [line.rstrip() for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        dedented = textwrap.dedent("\n".join(lines)).split("\n")
        is_prose = all(not line.startswith(" ") for line in dedented)
        paragraphs.append(" ".join(dedented) if is_prose else "\n".join(dedented))
    return "\n\n".join(paragraphs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dict", action="append", required=True, metavar="PREFIX",
                        help="dictd files without extension, e.g. /usr/share/dictd/devil; repeatable")
    parser.add_argument("--output", required=True, help="JSON-lines file to write")
    parser.add_argument("--min-chars", type=int, default=80,
                        help="drop entries shorter than this (bare cross-references)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    written = 0
    with open(args.output, "w", encoding="utf-8") as out:
        for prefix in args.dict:
            for _, raw in read_entries(prefix):
                text = entry_to_text(raw)
                if len(text) >= args.min_chars:
                    out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    written += 1
    logger.info("wrote %d documents to %s", written, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
