"""Signed checkpoints and proofs (contract §7 "Checkpoints", "Proofs"): ``waybill
checkpoint`` signs the ledger's Merkle tree into a directory outside the database,
``checkpoint keygen`` writes a keypair, ``prove`` writes one request's proof against a
checkpoint, ``verify-proof`` checks it with no database. (``verify --checkpoints`` is
``router.cli.verify``.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ledger.store import EventStore
from router.cli._shared import (
    CliError,
    DatabaseUrl,
    err,
    friendly_errors,
    load_public_keys,
    out,
    progress_bar,
    progress_callback,
    with_store,
)

__all__ = ["checkpoint_app", "prove_command", "verify_proof_command"]

checkpoint_app = typer.Typer(
    help="Sign the ledger's Merkle tree into a directory outside the database: "
    "`waybill checkpoint --signing-key FILE --out DIR`; `waybill checkpoint keygen --out DIR`.",
    invoke_without_command=True,
)


@checkpoint_app.callback()
def checkpoint_command(
    ctx: typer.Context,
    signing_key: Annotated[
        str | None, typer.Option("--signing-key", help="The private key file (PEM).")
    ] = None,
    out_dir: Annotated[
        str | None,
        typer.Option("--out", help="The sink directory the checkpoint is appended to."),
    ] = None,
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checkpoint.")] = False,
) -> None:
    """Take a checkpoint now: sign the tree at the ledger's head, append it to the sink."""
    from ledger.audit.checkpointer import Checkpointer
    from ledger.audit.sink import SinkError, checkpoint_file

    if ctx.invoked_subcommand is not None:
        return
    if not signing_key or not out_dir:
        err.print("[red]error:[/red] give --signing-key FILE and --out DIR (or: keygen --out DIR)")
        raise typer.Exit(2)
    with friendly_errors():
        key = _signing_key(signing_key)

    async def work(store: EventStore) -> tuple[Any, int]:
        checkpointer = Checkpointer(store, key, Path(out_dir))
        try:
            try:
                await checkpointer.open()
            except SinkError as error:
                raise CliError(str(error)) from None
            head, _ = await store.head()
            with progress_bar(transient=True) as progress:
                task = progress.add_task("hashing the ledger", total=head)
                progress.update(task, completed=checkpointer.size)
                await checkpointer.catch_up(lambda n: progress.advance(task, n))
            try:
                return await checkpointer.take(), checkpointer.size
            except SinkError as error:
                raise CliError(str(error)) from None
        finally:
            await checkpointer.close()

    checkpoint, _ = with_store(database_url, work)
    if as_json:
        sys.stdout.buffer.write(checkpoint.line())  # the sink's line, byte for byte
        return
    out.print(
        f"checkpoint taken: size {checkpoint.size}, root {checkpoint.root}, key "
        f"{checkpoint.key_id}, in {checkpoint_file(Path(out_dir), checkpoint)}",
        highlight=False,
    )


@checkpoint_app.command("keygen")
def checkpoint_keygen_command(
    out_dir: Annotated[str, typer.Option("--out", help="The directory to write the keypair to.")],
) -> None:
    """Write a new Ed25519 keypair: checkpoint-<key id>.key (private) and .pub (public)."""
    from ledger.audit.checkpoints import generate_key

    key = generate_key()
    directory = Path(out_dir)
    private, public = (directory / f"checkpoint-{key.key_id}.{s}" for s in ("key", "pub"))
    with friendly_errors():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(key.private_pem())
            public.write_bytes(key.public_pem())
        except OSError as error:
            problem = error.strerror or error
            raise CliError(f"cannot write the keypair in {out_dir}: {problem}") from None
    out.print(f"key id:      {key.key_id}", highlight=False)
    out.print(f"private key: {private}", highlight=False)
    out.print(f"public key:  {public}", highlight=False)
    err.print(
        "Keep the private key out of the database host's reach if you can; it signs (config "
        "checkpoints.signing_key). Give the public key to whoever verifies.",
        highlight=False,
    )


def prove_command(
    request_id: Annotated[str, typer.Argument(help="The request id (its X-Request-Id).")],
    checkpoints: Annotated[
        str, typer.Option("--checkpoints", help="The sink directory (or a copy of it).")
    ],
    signing_key: Annotated[
        str,
        typer.Option(
            "--signing-key",
            help="The private key file (PEM) that signs the request's version range.",
        ),
    ],
    size: Annotated[
        int | None,
        typer.Option("--size", min=1, help="Prove against the checkpoint of this size."),
    ] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Write a proof of the request's events against a signed checkpoint (JSON, stdout)."""
    from ledger.audit.proofs import ProofUnavailable, build_proof, choose_checkpoint
    from ledger.audit.sink import SinkError, TreeFiles, read_sink
    from ledger.views.queries import read_request_events

    directory = Path(checkpoints)
    with friendly_errors():
        key = _signing_key(signing_key)
        try:
            entries = read_sink(directory, strict=False)
            checkpoint = choose_checkpoint(entries, size)
        except (SinkError, ProofUnavailable) as error:
            raise CliError(f"{checkpoints}: {error}") from None
    for entry in entries:
        if entry.problem is not None:
            err.print(f"skipped {entry.where}: {entry.problem}", markup=False, highlight=False)

    async def work(store: EventStore) -> bytes:
        # Read after the checkpoint was chosen: the trail holds every event it covers.
        trail = await read_request_events(store.engine, request_id)
        if not trail:
            raise CliError(f"no request {request_id!r} in the ledger")
        tree = TreeFiles(directory)
        try:
            with progress_bar(transient=True) as progress:
                task = progress.add_task("hashing the ledger", total=None)
                return await build_proof(
                    store.engine,
                    request_id,
                    trail,
                    checkpoint,
                    tree,
                    key,
                    progress=progress_callback(progress, task),
                )
        except ProofUnavailable as error:
            raise CliError(str(error)) from None
        finally:
            tree.close()

    document = with_store(database_url, work)
    sys.stdout.buffer.write(document)
    sys.stdout.flush()


def verify_proof_command(
    proof_file: Annotated[str, typer.Argument(help="A proof written by `waybill prove`.")],
    public_key: Annotated[
        list[str],
        typer.Option("--public-key", help="A public key the checkpoint may be signed with."),
    ],
) -> None:
    """Check a proof alone, with no database and no network: exit 0, or 1 naming what failed."""
    from ledger.audit.proofs import ProofInvalid, check_proof

    with friendly_errors():
        keys = load_public_keys(public_key)
        try:
            document = Path(proof_file).read_bytes()
        except OSError as error:
            raise CliError(f"cannot read {proof_file}: {error.strerror or error}") from None
    try:
        summary = check_proof(document, keys)
    except ProofInvalid as error:
        out.print(f"proof FAILED: {error}", highlight=False, markup=False)
        raise typer.Exit(1) from None
    signed = summary.checkpoint
    out.print(
        f"proof OK: request {summary.request_id}: {len(summary.types)} events "
        f"({', '.join(summary.types)}), versions 1..{len(summary.types)}, every event of its "
        f"stream up to position {signed.size} (range signed by key {summary.stream_key_id}), "
        f"are in the ledger's tree of size {signed.size}, signed by key {signed.key_id} at "
        f"{signed.time}",
        highlight=False,
        markup=False,
    )


def _signing_key(path: str) -> Any:
    from ledger.audit.checkpoints import KeyFileError, load_signing_key

    try:
        return load_signing_key(Path(path).read_bytes())
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror or error}") from None
    except KeyFileError as error:
        raise CliError(f"{path}: {error}") from None
