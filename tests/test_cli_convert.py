"""The CLI's convert/generate commands: bad input ends in one line, never a wrong dataset."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fullgraph.cli import main

N = 50


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("FULLGRAPH_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def _arrays(tmp_path: Path, labels: np.ndarray | None = None) -> list[str]:
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((N, 4)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.arange(N) % 3 if labels is None else labels)
    return ["--features", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy")]


def _binary_edges(tmp_path: Path, dtype: str) -> Path:
    rng = np.random.default_rng(1)
    pairs = rng.integers(0, N, (300, 2))
    path = tmp_path / f"edges.{dtype}"
    pairs.astype(dtype).tofile(path)
    return path


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_int64_edges_given_as_uint32_are_refused(root, tmp_path, capsys):
    edges = _binary_edges(tmp_path, "<i8")
    rc = main(["convert", "edgelist", "--name", "g", "--edges", str(edges), "--binary",
               "uint32", *_arrays(tmp_path)])
    err = _one_line_error(capsys)
    assert rc == 2 and str(edges) in err and "--binary int64" in err
    assert not (root / "g").exists()
    assert main(["convert", "edgelist", "--name", "g", "--edges", str(edges), "--binary",
                 "int64", *_arrays(tmp_path)]) == 0


def test_uint32_edges_given_as_int64_are_refused(root, tmp_path, capsys):
    edges = _binary_edges(tmp_path, "<u4")
    rc = main(["convert", "edgelist", "--name", "g", "--edges", str(edges), "--binary",
               "int64", *_arrays(tmp_path)])
    err = _one_line_error(capsys)
    assert rc == 2 and str(edges) in err and "--binary uint32" in err


def test_help_documents_the_binary_layouts(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = capsys.readouterr().out
    assert "little-endian" in out and "8 bytes per edge" in out and "16 bytes per edge" in out


def test_huge_label_is_refused_at_convert(root, tmp_path, capsys):
    edges = _binary_edges(tmp_path, "<i8")
    labels = np.arange(N) % 3
    labels[7] = 10_000_000_000
    rc = main(["convert", "edgelist", "--name", "g", "--edges", str(edges), "--binary",
               "int64", *_arrays(tmp_path, labels)])
    err = _one_line_error(capsys)
    assert rc == 2 and "implausible class count" in err and "--num-classes" in err
    assert not (root / "g").exists()


def test_num_classes_flag_is_used(root, tmp_path, capsys):
    edges = _binary_edges(tmp_path, "<i8")
    labels = np.arange(N) % 3
    labels[7] = 40  # 4 distinct labels, 41 classes: refused unless stated
    args = ["convert", "edgelist", "--name", "g", "--edges", str(edges), "--binary", "int64",
            *_arrays(tmp_path, labels)]
    assert main(args) == 2
    assert main([*args, "--num-classes", "41"]) == 0
    assert json.loads((root / "g" / "processed" / "meta.json").read_text())["num_classes"] == 41
    assert main([*args, "--num-classes", "40"]) == 2  # below the largest label
    assert "label out of range" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_labels_beyond_stated_classes_stop_training(root, tmp_path, capsys, workers):
    edges = _binary_edges(tmp_path, "<i8")
    assert main(["convert", "edgelist", "--name", "g", "--edges", str(edges), "--binary",
                 "int64", *_arrays(tmp_path, np.arange(N) % 8)]) == 0
    meta_file = root / "g" / "processed" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["num_classes"] = 3
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    rc = main(["train", "--dataset", "g", "--epochs", "1", "--progress", "off",
               "--workers", str(workers), "--strategy", "data" if workers > 1 else "single"])
    err = _one_line_error(capsys)
    assert rc == 2 and "'g'" in err and "max label 7, num_classes 3" in err


@pytest.mark.parametrize("name", ["../../escape", "..", "a/b", ".hidden", ""])
def test_names_that_are_paths_are_refused(root, tmp_path, capsys, name):
    edges = _binary_edges(tmp_path, "<i8")
    rc = main(["convert", "edgelist", "--name", name, "--edges", str(edges), "--binary",
               "int64", *_arrays(tmp_path)])
    assert rc == 2 and "is not a name" in _one_line_error(capsys)
    rc = main(["generate", "sbm", "--vertices", "60", "--features", "4", "--classes", "2",
               "--name", name])
    assert rc == 2 and "is not a name" in _one_line_error(capsys)
    rc = main(["train", "--dataset", name or " ", "--epochs", "1", "--progress", "off"])
    err = _one_line_error(capsys)  # (a path that does not exist is said to be one)
    assert rc == 2 and ("is not a name" in err or "no such directory" in err), err
    written = [p for p in tmp_path.rglob("*") if p.suffix not in (".npy", ".<i8")]
    assert written == [], written


def test_ogb_takes_symmetrize_and_split_scheme(root, tmp_path, capsys):
    """OGB graphs are made undirected unless --no-symmetrize (which was ignored), and a
    directory with several split schemes is read with --split-scheme (no flag had it)."""
    raw, n = tmp_path / "og", 10
    (raw / "raw").mkdir(parents=True)
    (raw / "raw" / "edge.csv").write_text("".join(f"{i},{(i + 1) % n}\n" for i in range(n)))
    (raw / "raw" / "node-feat.csv").write_text("1,2,3\n" * n)
    (raw / "raw" / "node-label.csv").write_text("".join(f"{i % 3}\n" for i in range(n)))
    for scheme in ("random", "time"):
        (raw / "split" / scheme).mkdir(parents=True)
        for split, ids in (("train", "0\n1\n2\n3\n"), ("valid", "4\n5\n"), ("test", "6\n7\n")):
            (raw / "split" / scheme / f"{split}.csv").write_text(ids)
    ogb = ["convert", "ogb", "--input", str(raw)]
    assert main([*ogb, "--name", "a"]) == 2
    assert "choose one with --split-scheme" in _one_line_error(capsys)
    for i, (flags, edges) in enumerate((([], 2 * n), (["--symmetrize"], 2 * n),
                                        (["--no-symmetrize"], n))):
        assert main([*ogb, "--name", "b", "--split-scheme", "time", *flags]) == 0
        out, err = capsys.readouterr()
        assert f"{n} vertices, {edges} edges" in out and "no effect" not in err, (flags, out)
        assert ("replacing the dataset that was there" in out) == (i > 0), out


def test_sigterm_while_writing_leaves_nothing_behind(root):
    """SIGTERM ends `generate` as Ctrl-C does: its temporary directory is removed (it
    was left behind, tens of MB of partial arrays), and the exit is by the signal."""
    import signal
    import subprocess
    import time

    from clirun import clean_env, fullgraph_cmd

    proc = subprocess.Popen(fullgraph_cmd() + ["generate", "rmat", "--name", "big", "--vertices",
                                               "2000000", "--edges", "40000000"],
                            env=clean_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not list((root / "big").glob(".*tmp-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err)
    assert "fullgraph generate: stopped by SIGTERM" in err, err
    assert not (root / "big").exists()  # nor the folder made for the first write


def test_a_signal_swallowed_in_a_callback_from_c_is_raised_again():
    """SIGTERM that lands in a callback from C (numba's compiler calls some through
    ctypes) raises there, where the exception is swallowed: the signal is sent again and
    raised where it unwinds, so that the files being written are still removed (the run
    went on to finish and exit 0)."""
    import ctypes
    import signal
    import time

    from fullgraph import cli

    def interrupted() -> None:
        raise cli._Terminated(signal.SIGTERM)

    callback = ctypes.CFUNCTYPE(None)(interrupted)
    with pytest.raises(cli._Terminated):
        with cli._stopped_by_signals(True):
            callback()  # swallowed by ctypes, handed to sys.unraisablehook
            time.sleep(5)  # the signal sent again lands here
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_directory_or_a_compressed_binary_file_is_named_as_such(root, tmp_path, capsys):
    rc = main(["convert", "edgelist", "--name", "g", "--edges", str(tmp_path),
               *_arrays(tmp_path)])
    assert rc == 2 and "file is a directory; expected a regular file" in _one_line_error(capsys)
    import gzip

    edges = _binary_edges(tmp_path, "<u4")
    packed = tmp_path / "edges.u32.gz"
    packed.write_bytes(gzip.compress(edges.read_bytes()))
    rc = main(["convert", "edgelist", "--name", "g", "--edges", str(packed), "--binary",
               "uint32", *_arrays(tmp_path)])
    err = _one_line_error(capsys)
    assert rc == 2 and "binary edge file is gzip-compressed" in err and "gunzip" in err
    assert not (root / "g").exists()
    # raw ids whose first bytes happen to read 1f 8b 08 00 are edges, not gzip
    from fullgraph.graph.formats.edgelist import read_binary_pairs

    raw = tmp_path / "edges.u32"
    raw.write_bytes(b"\x1f\x8b\x08\x00" + np.arange(7, dtype="<u4").tobytes())
    assert read_binary_pairs(raw, "uint32")[0, 0] == 0x00088B1F


def test_a_dataset_without_its_metadata_or_manifest_is_named_not_unknown(root, tmp_path,
                                                                        capsys):
    edges = tmp_path / "e.txt"
    edges.write_text("".join(f"{i} {(i + 1) % N}\n" for i in range(N)))
    assert main(["convert", "edgelist", "--name", "g", "--edges", str(edges),
                 *_arrays(tmp_path)]) == 0
    (root / "g" / "processed" / "meta.json").unlink()
    assert main(["datasets", "g"]) == 2
    assert "meta.json: dataset metadata is missing" in _one_line_error(capsys)
    assert main(["partition", "--dataset", "cora", "--parts", "2", "--partitioner", "chunk",
                 "--shards", str(root / "sh")]) == 0
    (root / "sh" / "shards.json").unlink()
    capsys.readouterr()
    assert main(["datasets", "sh"]) == 2  # a bare name, in the root
    assert "holds part-* folders but no shards.json" in _one_line_error(capsys)
    # a folder of other files (arrays to convert, part-00000 of another tool) is unknown
    other = root / "mine"
    other.mkdir()
    np.save(other / "x.npy", np.zeros((3, 2)))
    (other / "part-00000").write_text("a b\n")
    assert main(["datasets", "mine"]) == 2
    assert "unknown dataset; found 'mine'" in _one_line_error(capsys)


def test_a_closed_pipe_ends_the_listing_quietly(root):
    import subprocess
    import sys

    code = ("import sys; from fullgraph.cli import main; "
            "sys.exit(main(['datasets']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # as `| head -0` does: every write finds the pipe closed
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 141) and b"error" not in err and b"Traceback" not in err


def test_labels_all_unknown_are_named_as_the_cause_of_an_empty_split(root, tmp_path, capsys):
    """Such data (or none given) converts, for predict, and training it is refused."""
    edges = tmp_path / "e.txt"
    edges.write_text("".join(f"{i} {(i + 1) % N}\n" for i in range(N)))
    with pytest.warns(UserWarning, match="g has no training vertices"):
        assert main(["convert", "edgelist", "--name", "g", "--edges", str(edges),
                     *_arrays(tmp_path, labels=-np.ones(N, dtype=np.int64))]) == 0
    rc = main(["train", "--dataset", "g", "--epochs", "1", "--progress", "off"])
    err = _one_line_error(capsys)
    assert rc == 2 and "the train mask is empty" in err and "every label is -1" in err


def test_a_model_predicts_on_a_graph_converted_without_labels(root, tmp_path, capsys):
    """convert refused a graph without labels, so predict had nothing to run on."""
    edges = tmp_path / "e.txt"
    edges.write_text("".join(f"{i} {(i * 7 + 1) % N}\n" for i in range(N)))
    arrays = _arrays(tmp_path)
    assert main(["convert", "edgelist", "--name", "g", "--edges", str(edges), *arrays]) == 0
    assert main(["train", "--dataset", "g", "--epochs", "2", "--progress", "off", "-q",
                 "--save-model", str(tmp_path / "m.pt")]) == 0
    with pytest.warns(UserWarning, match="new has no training vertices"):
        assert main(["convert", "edgelist", "--name", "new", "--edges", str(edges),
                     *arrays[:2]]) == 0
    capsys.readouterr()
    assert main(["predict", "--model", str(tmp_path / "m.pt"), "--dataset", "new", "--out",
                 str(tmp_path / "p.npy")]) == 0
    assert np.load(tmp_path / "p.npy").shape == (N,)
    assert main(["evaluate", "--model", str(tmp_path / "m.pt"), "--dataset", "new"]) == 0
    assert "test  accuracy     n/a (0/0)" in capsys.readouterr().out


def test_a_broken_pipe_that_is_not_standard_output_is_an_error(root, monkeypatch, capsys):
    """A FIFO given as --metrics-out whose reader went away, say: not ended quietly."""
    from fullgraph import cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli.COMMANDS, "datasets", broken)
    assert main(["datasets"]) == 2
    assert "fullgraph datasets: error: broken pipe" in capsys.readouterr().err


def _edges(tmp_path: Path, loops: int = 0) -> str:
    lines = [f"{i} {(i * 7 + 1) % N}" for i in range(N)] + [f"{i} {i}" for i in range(loops)]
    (tmp_path / "e.txt").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "e.txt")


def test_convert_reads_paths_with_a_tilde_and_stores_the_absolute_source(root, tmp_path,
                                                                         monkeypatch, capsys):
    """A quoted ``~/...`` input was "not found (place the file at ~/...)", where it
    was; and the stored source was the path as typed (``e.txt``, meaningless later)."""
    from fullgraph.graph.store import load_dataset

    monkeypatch.setenv("HOME", str(tmp_path))
    _edges(tmp_path)
    _arrays(tmp_path)
    assert main(["convert", "edgelist", "--name", "t", "--edges", "~/e.txt", "--features",
                 "~/x.npy", "--labels", "~/y.npy"]) == 0
    assert load_dataset(root / "t" / "processed").info["source"] == str(tmp_path / "e.txt")


def test_convert_takes_scipy_sparse_features_and_keeps_them_sparse(root, tmp_path, capsys):
    """Bag-of-words features had to be written dense (a 499 MB .npy for Coauthor CS)
    and were held dense while converting."""
    import scipy.sparse as sp
    import torch

    from fullgraph.graph.datasets import load

    dense = np.zeros((N, 80), dtype=np.float32)
    dense[np.arange(N), np.arange(N) % 80] = 1.0
    sp.save_npz(tmp_path / "x.npz", sp.csr_matrix(dense))
    np.save(tmp_path / "xd.npy", dense)
    np.save(tmp_path / "y.npy", np.arange(N) % 3)
    for name, features in (("s", "x.npz"), ("d", "xd.npy")):
        assert main(["convert", "edgelist", "--name", name, "--edges", _edges(tmp_path),
                     "--features", str(tmp_path / features), "--labels",
                     str(tmp_path / "y.npy")]) == 0
    assert "(features stored sparse)" in capsys.readouterr().out
    got, want = load("s", root).data.features, load("d", root).data.features
    assert got.layout == torch.sparse_csr and torch.equal(got.to_dense(), want.to_dense())
    np.savez(tmp_path / "bad.npz", format=np.array("csr"), shape=np.array([N, 3]),
             data=np.ones(2))
    assert main(["convert", "edgelist", "--name", "b", "--edges", _edges(tmp_path),
                 "--features", str(tmp_path / "bad.npz"), "--labels",
                 str(tmp_path / "y.npy")]) == 2
    assert "not a readable scipy sparse .npz" in _one_line_error(capsys)


@pytest.mark.parametrize("mode, said, loops", [
    ("keep", ", 3 self-loops kept", 3), ("remove", ", 3 self-loops dropped", 0),
    ("add", ", a self-loop on every vertex", N)])
def test_convert_keeps_drops_or_adds_self_loops(root, tmp_path, capsys, mode, said, loops):
    """train's SAGE warning said to "convert the edges without them", and convert had
    no way to; nor did it say it kept any."""
    from fullgraph.graph.datasets import load

    assert main(["convert", "edgelist", "--name", "g", "--edges", _edges(tmp_path, loops=3),
                 *_arrays(tmp_path), "--self-loops", mode]) == 0
    assert said in capsys.readouterr().out
    src, dst = load("g", root).graph.edges()
    assert int((src == dst).sum()) == loops


def test_convert_warns_that_a_seed_has_no_effect_with_masks(root, tmp_path):
    masks = np.zeros((3, N), dtype=bool)
    masks[0, :30], masks[1, 30:40], masks[2, 40:] = True, True, True
    np.save(tmp_path / "m.npy", masks)
    with pytest.warns(UserWarning, match="--seed has no effect with --masks"):
        assert main(["convert", "edgelist", "--name", "g", "--edges", _edges(tmp_path),
                     *_arrays(tmp_path), "--masks", str(tmp_path / "m.npy"),
                     "--seed", "5"]) == 0


def test_datasets_describes_the_folder_convert_made_and_what_is_stored(root, tmp_path,
                                                                       capsys):
    """``datasets ROOT/NAME`` was "not a name" (only ROOT/NAME/processed was taken); the
    description said nothing of the stored dtype, layout or self-loops, and printed a
    generator's split fractions as "train"/"val" under the split counts."""
    assert main(["generate", "rmat", "--vertices", "300", "--edges", "2000", "--name", "r",
                 "--feature-dtype", "float16"]) == 0
    capsys.readouterr()
    assert main(["datasets", str(root / "r")]) == 0
    out = capsys.readouterr().out
    assert "stored: float16 features, dense" in out and "self-loops: 0" in out
    assert "train_fraction: 0.6" in out and "train: 180" in out
    assert not any(line.strip() == "train: 0.6" for line in out.splitlines())


def test_generates_default_name_tells_draws_apart(capsys):
    """A second draw with another seed, labels or classes replaced the first under the
    same ``rmat-V-E`` name; the defaults still give that name."""
    from fullgraph.cli import _generated_name, _kind_options, build_parser

    def name(*argv: str) -> str:
        args = build_parser().parse_args(["generate", *argv])
        _kind_options(args)
        return _generated_name(args)

    assert name("rmat") == "rmat-10000-100000"
    assert name("sbm", "--classes", "5") == "sbm-10000-5"
    assert name("rmat", "--vertices", "20", "--edges", "50", "--seed", "7", "--labels",
                "degree", "--classes", "4", "--symmetrize") == "rmat-20-50-c4-sym-degree-seed7"
    assert name("sbm", "--homophily", "0.9", "--features", "8") == "sbm-10000-16-f8-h0.9"


def test_a_shard_set_under_the_name_is_refused_before_it_shadows_the_new_data(
        root, tmp_path, capsys):
    """``--dataset NAME`` opens a shard set in ROOT/NAME before ROOT/NAME/processed: a
    convert or generate under that name said "wrote" while training went on reading the
    old shards."""
    edges = _edges(tmp_path)
    assert main(["convert", "edgelist", "--name", "g", "--edges", edges,
                 *_arrays(tmp_path)]) == 0
    assert main(["partition", "--dataset", "g", "--parts", "2", "--partitioner", "chunk",
                 "--shards", str(root / "h")]) == 0
    capsys.readouterr()
    assert main(["convert", "edgelist", "--name", "h", "--edges", edges,
                 *_arrays(tmp_path)]) == 2
    assert "holds per-part shards" in _one_line_error(capsys)
    assert main(["generate", "sbm", "--vertices", "60", "--name", "h"]) == 2
    assert "holds per-part shards" in _one_line_error(capsys)
    assert not (root / "h" / "processed").exists()


def test_a_root_that_cannot_be_written_is_named_before_the_input_is_read(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    rc = main(["convert", "edgelist", "--root", str(tmp_path / "file" / "sub"), "--name", "g",
               "--edges", str(tmp_path / "missing.txt"), *_arrays(tmp_path)])
    err = _one_line_error(capsys)
    assert rc == 2 and "--root" in err and "missing.txt" not in err


def test_datasets_says_whether_convert_symmetrized(root, tmp_path, capsys):
    edges = _edges(tmp_path)
    for name, flag in (("d", "--no-symmetrize"), ("s", "--symmetrize")):
        assert main(["convert", "edgelist", "--name", name, "--edges", edges, flag,
                     "--self-loops", "add", *_arrays(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["datasets", "d"]) == 0
    assert "converted with: --no-symmetrize --self-loops add" in capsys.readouterr().out
    assert main(["datasets", "s"]) == 0
    assert "converted with: --symmetrize --self-loops add" in capsys.readouterr().out


def test_binary_or_unsuffixed_gzip_edges_read_as_text(root, tmp_path, capsys):
    """A binary edge file given without --binary failed on "line 1: wrong number of
    values" with no hint; gzip text without the .gz suffix likewise."""
    import gzip

    edges = _binary_edges(tmp_path, "<u4")
    assert main(["convert", "edgelist", "--name", "g", "--edges", str(edges),
                 *_arrays(tmp_path)]) == 2
    assert "--binary uint32 or --binary int64" in _one_line_error(capsys)
    packed = tmp_path / "edges.txt"
    packed.write_bytes(gzip.compress(Path(_edges(tmp_path)).read_bytes()))
    assert main(["convert", "edgelist", "--name", "z", "--edges", str(packed),
                 *_arrays(tmp_path)]) == 0


def test_an_explicit_class_count_far_beyond_the_labels_warns(root, tmp_path):
    with pytest.warns(UserWarning, match="num_classes 400,000,000 is given for 3 distinct"):
        assert main(["convert", "edgelist", "--name", "g", "--edges", _edges(tmp_path),
                     "--num-classes", "400000000", *_arrays(tmp_path)]) == 0


def test_a_damaged_gzip_or_a_binary_file_that_begins_like_one_is_one_error(root, tmp_path,
                                                                              capsys):
    """The binary-file hint re-read the file: a truncated gzip stream, or binary ids
    whose first bytes are gzip's magic (id 559903), ended in a traceback."""
    import gzip

    whole = gzip.compress(Path(_edges(tmp_path)).read_bytes())
    (tmp_path / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "cut").write_bytes(whole[: len(whole) // 2])
    pairs = np.array([[559903, 1]] + [[i, (i + 1) % N] for i in range(N)], dtype="<u4")
    pairs.tofile(tmp_path / "magic.u32")
    for name in ("cut.txt.gz", "cut", "magic.u32"):
        assert main(["convert", "edgelist", "--name", "g", "--edges", str(tmp_path / name),
                     *_arrays(tmp_path)]) == 2
        _one_line_error(capsys)


def test_no_labels_with_a_class_count_does_not_warn_of_a_typo(root, tmp_path):
    import warnings

    edges = _edges(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["convert", "edgelist", "--name", "g", "--edges", edges,
                     "--num-classes", "47", *_arrays(tmp_path)[:2]]) == 0
    assert not [w for w in caught if "typo" in str(w.message)]
