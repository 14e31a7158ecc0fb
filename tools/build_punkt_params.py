"""Trains nltk Punkt sentence-splitter parameters on JSON-lines text and saves them as JSON.

nltk's pretrained `punkt` model is a download these machines cannot make; this builds the
file that `tools/preprocess_data.py --split-sentences` loads by default instead.

    python tools/build_punkt_params.py --input datasets_gpt/dataset.json \
        datasets_bert/dataset.json --output tools/punkt_english.json.gz
"""

import argparse
import logging
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.document_encoder import save_punkt_params, train_punkt_params  # noqa: E402

logger = logging.getLogger("build_punkt_params")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines files")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--output", required=True, help="parameters file (.json or .json.gz)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    params = train_punkt_params(args.input, args.json_keys)
    save_punkt_params(params, args.output)
    logger.info(
        "wrote %s: %d abbreviations, %d collocations, %d sentence starters",
        args.output, len(params.abbrev_types), len(params.collocations),
        len(params.sent_starters),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
