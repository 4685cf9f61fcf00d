"""Token cache build rate against the tokenizer's own batch rate, and the build's peak memory against the corpus size.

The corpus is synthesised: Parquet shards with the columns of the ``wikimedia/wikipedia`` dataset (id, url, title,
text) filled with WikiText-2's articles over and over (``--articles``, default ../shared/data/wikitext2/train.json;
random words without it), tokenised by a byte-level BPE of ``--vocab`` tokens trained on the first MB of them.

Rate: on the same ``--rate-mb`` MB of documents, the tokenizer's own ``encode_batch`` (and ``encode_batch_fast``) in
batches of ``CHARACTERS_PER_BATCH`` characters as the build takes them, and ``build_token_cache`` over a Parquet file
of those documents (reading, encoding, writing and committing); alternated ``--repeats`` times, medians reported.

Memory: a fresh process builds the cache of the first of ``--shards`` shards of ``--shard-mb`` MB of text each, and
another the cache of all of them. Each resets its peak RSS once the imports and the tokenizer are loaded (Linux
``/proc/self/clear_refs``), so the growth is the build's own, set against the text the shards hold. One JSON row is
appended to ``--out``.

    python scripts/bench_corpus.py --shards 8 --shard-mb 64 --out runs/bench_corpus.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lit_fsdp from this checkout

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from lit_fsdp.data import token_cache  # noqa: E402
from lit_fsdp.data.corpus import Corpus, read_documents  # noqa: E402
from lit_fsdp.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext2" / "train.json"
#: Rows per Parquet row group: about 3 MB of WikiText-2's articles, as the wikimedia/wikipedia shards' groups of 1000
#: 3 kB articles. pyarrow decodes a whole row group of the columns read, so that, not the file, bounds the reading.
ROWS_PER_ROW_GROUP = 150
#: Rows per Parquet data page. The writer closes a page only between batches of this many rows, so at WikiText-2's
#: 20 kB articles the default 1024 makes 20 MB pages, which a reader holds whole; 128 makes pages of about 2.5 MB,
#: as the default makes them for Wikipedia's 3 kB articles.
ROWS_PER_PAGE = 128


def article_pool(path: Path) -> list[tuple[str, str]]:
    """``(title, text)`` of every article of ``path``, or of 2,000 articles of random words when it is absent."""
    if path.is_file():
        return [(document.split("\n", 1)[0], document.split("\n", 1)[1]) for document in read_documents(path)
                if "\n" in document]
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 10))) for _ in range(20_000)]
    return [(f"Article {i}", " ".join(rng.choice(words, size=int(rng.integers(100, 1500))))) for i in range(2000)]


def write_shard(path: Path, pool: list[tuple[str, str]], first: int, text_bytes: int) -> tuple[int, int]:
    """A Parquet shard of articles ``first, first + 1, ...`` of the pool (cycled) holding ``text_bytes`` of text,
    written a row group at a time; returns the next article's index and the text written."""
    schema = pa.schema([("id", pa.string()), ("url", pa.string()), ("title", pa.string()), ("text", pa.string())])
    index, written = first, 0
    with pq.ParquetWriter(path, schema, write_batch_size=ROWS_PER_PAGE) as writer:
        while written < text_bytes:
            rows = {"id": [], "url": [], "title": [], "text": []}
            for _ in range(ROWS_PER_ROW_GROUP):
                title, text = pool[index % len(pool)]
                rows["id"].append(str(index))
                rows["url"].append(f"https://en.wikipedia.org/wiki?curid={index}")
                rows["title"].append(f"{title} ({index // len(pool)})")
                rows["text"].append(text)
                written += len(text)
                index += 1
                if written >= text_bytes:
                    break
            writer.write_table(pa.table(rows, schema=schema))
    return index, written


def median_rate(runs: list[tuple[int, float]]) -> float:
    return statistics.median(tokens / seconds for tokens, seconds in runs)


def rate_comparison(tokenizer_dir: Path, pool: list[tuple[str, str]], megabytes: float, repeats: int, work: Path) -> dict:
    """Tokens per second of ``encode_batch``, ``encode_batch_fast`` and the cache build on the same documents."""
    shard = work / "rate.parquet"
    _, text_bytes = write_shard(shard, pool, 0, int(megabytes * 1e6))
    corpus = Corpus.of(shard)
    documents = list(read_documents(corpus))
    batches = [batch for batch, _ in token_cache._chunks(((d, 0) for d in documents), token_cache.CHARACTERS_PER_BATCH)]
    tokenizer = load_tokenizer(tokenizer_dir)
    backend = tokenizer.backend_tokenizer
    runs: dict[str, list[tuple[int, float]]] = {"encode_batch": [], "encode_batch_fast": [], "build": []}
    for repeat in range(repeats):
        for name, encode in (("encode_batch", backend.encode_batch), ("encode_batch_fast", backend.encode_batch_fast)):
            started, tokens = time.perf_counter(), 0
            for batch in batches:
                tokens += sum(len(encoding.ids) for encoding in encode(batch, add_special_tokens=False))
            runs[name].append((tokens, time.perf_counter() - started))
        started = time.perf_counter()
        meta = token_cache.build_token_cache(work / f"rate-cache-{repeat}", corpus, tokenizer)
        runs["build"].append((meta["tokens"], time.perf_counter() - started))
        shutil.rmtree(work / f"rate-cache-{repeat}")
    rates = {f"{name}_tokens_per_s": round(median_rate(values)) for name, values in runs.items()}
    return {
        "text_bytes": text_bytes, "documents": len(documents), "tokens": runs["build"][0][0], "repeats": repeats,
        **rates, "build_over_encode_batch": round(rates["build_tokens_per_s"] / rates["encode_batch_tokens_per_s"], 3),
        "build_over_encode_batch_fast": round(rates["build_tokens_per_s"] / rates["encode_batch_fast_tokens_per_s"], 3),
    }


def measure_build(work: Path, shards: int) -> None:
    """In a fresh process: build the cache of the first ``shards`` of ``work/shards`` and print what it took (one
    JSON line)."""
    tokenizer = load_tokenizer(work / "tokenizer")
    files = tuple(sorted((work / "shards").glob("*.parquet"))[:shards])
    corpus = Corpus(str(work / "shards"), files)
    Path("/proc/self/clear_refs").write_text("5")  # the peak so far (imports, tokenizer) is not the build's
    start = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    started = time.perf_counter()
    meta = token_cache.build_token_cache(work / f"cache-{shards}", corpus, tokenizer)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"shards": shards, "parquet_bytes": sum(file.stat().st_size for file in files),
                      "documents": meta["documents"], "tokens": meta["tokens"], "seconds": round(seconds, 1),
                      "tokens_per_s": round(meta["tokens"] / seconds), "start_rss_bytes": start,
                      "peak_rss_bytes": peak, "grown_bytes": peak - start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_corpus.jsonl"))
    parser.add_argument("--articles", type=Path, default=WIKITEXT, help="Wikipedia-format JSON the shards repeat")
    parser.add_argument("--vocab", type=int, default=8192, help="tokens of the byte-level BPE")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mb", type=float, default=64.0, help="MB of text per shard")
    parser.add_argument("--rate-mb", type=float, default=16.0, help="MB of text the rates are measured on")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--characters-per-batch", type=int, default=token_cache.CHARACTERS_PER_BATCH,
                        help="characters encoded in one batch (the build's memory)")
    parser.add_argument("--characters-per-chunk", type=int, default=token_cache.CHARACTERS_PER_CHUNK,
                        help="characters committed together (the work a killed build redoes)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--measure-build", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure-shards", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    token_cache.CHARACTERS_PER_BATCH, token_cache.CHARACTERS_PER_CHUNK = args.characters_per_batch, args.characters_per_chunk
    if args.measure_build is not None:
        measure_build(args.measure_build, args.measure_shards)
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    pool = article_pool(args.articles)
    sample, size = [], 0
    for title, text in pool:
        sample.append(f"{title}\n{text}")
        size += len(text)
        if size > 1e6:
            break
    train_bpe(sample, args.vocab).save_pretrained(work / "tokenizer")

    rates = rate_comparison(work / "tokenizer", pool, args.rate_mb, args.repeats, work)
    print(f"rate on {rates['text_bytes'] / 1e6:.1f} MB: encode_batch {rates['encode_batch_tokens_per_s']:,} tokens/s, "
          f"encode_batch_fast {rates['encode_batch_fast_tokens_per_s']:,}, cache build {rates['build_tokens_per_s']:,} "
          f"({rates['build_over_encode_batch']:.2f}x encode_batch)", flush=True)

    (work / "shards").mkdir(exist_ok=True)
    index, text_bytes = 0, []
    for n in range(args.shards):
        index, written = write_shard(work / "shards" / f"train-{n:05d}-of-{args.shards:05d}.parquet", pool, index,
                                     int(args.shard_mb * 1e6))
        text_bytes.append(written)
    sizes = ["--characters-per-batch", str(args.characters_per_batch), "--characters-per-chunk",
             str(args.characters_per_chunk)]
    memory = []
    for shards in sorted({1, args.shards}):
        result = subprocess.run([sys.executable, __file__, "--measure-build", str(work), "--measure-shards",
                                 str(shards), *sizes], capture_output=True, text=True, check=True)
        build = {"text_bytes": sum(text_bytes[:shards]), **json.loads(result.stdout.strip().splitlines()[-1])}
        build["text_over_grown"] = round(build["text_bytes"] / build["grown_bytes"], 2)
        memory.append(build)
        print(f"memory: {build['text_bytes'] / 1e6:.0f} MB of text in {shards} shards "
              f"({build['parquet_bytes'] / 1e6:.0f} MB of Parquet), {build['tokens']:,} tokens in "
              f"{build['seconds']:.0f} s ({build['tokens_per_s']:,} tokens/s); the build's peak RSS rose "
              f"{build['grown_bytes'] / 2**20:.0f} MiB above its start ({build['peak_rss_bytes'] / 2**20:.0f} MiB in "
              f"all): the text is {build['text_over_grown']:.1f}x that", flush=True)

    row = {
        "bench": "corpus", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_average": os.getloadavg(),
        "cpus": os.cpu_count(), "articles": str(args.articles) if args.articles.is_file() else "random words",
        "vocab": args.vocab, "characters_per_chunk": token_cache.CHARACTERS_PER_CHUNK,
        "characters_per_batch": token_cache.CHARACTERS_PER_BATCH, "rate": rates, "memory": memory,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(json.dumps(row) + "\n")
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
