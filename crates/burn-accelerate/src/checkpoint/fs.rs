//! Durable file operations: every file is written and synced before it counts, and a checkpoint folder only
//! appears under its final name once it is complete.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub(crate) fn io(operation: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Io {
        operation,
        path,
        source,
    }
}

/// Writes `bytes` to `path` and syncs it to disk.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = File::create(path).map_err(io("creating", path))?;
    file.write_all(bytes).map_err(io("writing", path))?;
    file.sync_all().map_err(io("syncing", path))
}

/// The folder `path` is in (`.` for a bare file name, whose `parent()` is empty).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Writes `bytes` to `path` atomically: a temporary file in the same folder, synced, then renamed.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = with_suffix(path, ".partial");
    write_synced(&tmp, bytes)?;
    fs::rename(&tmp, path).map_err(io("renaming into place", path))?;
    sync_dir(parent_dir(path))
}

/// Syncs a folder, so that renames inside it survive a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing folder", dir))?;
    }
    let _ = dir;
    Ok(())
}

/// `path` with `suffix` appended to its last component.
pub(crate) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(suffix);
    path.with_file_name(name)
}

/// Reads a whole file, naming it in the error.
pub(crate) fn read(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(io("reading", path))
}
