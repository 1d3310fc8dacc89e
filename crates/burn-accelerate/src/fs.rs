//! Durable file operations: every file is written and synced before it counts, and a checkpoint folder only
//! appears under its final name once it is complete.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::Result;
pub(crate) use crate::error::io;

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

/// A new, empty temporary file beside `path`, created exclusively under a name no other writer uses
/// (`<name>.partial.<pid>.<n>`): a file or symbolic link already there is never followed or overwritten, and
/// two writers of the same file never share a temporary.
pub(crate) fn create_temporary(path: &Path) -> Result<(PathBuf, File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = with_suffix(path, &format!(".partial.{}.{n}", std::process::id()));
        match File::options().write(true).create_new(true).open(&tmp) {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io("creating", &tmp)(e)),
        }
    }
}

/// Writes `bytes` to `path` atomically: an exclusively created temporary file in the same folder, synced, then
/// renamed over `path`.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let (tmp, mut file) = create_temporary(path)?;
    let written = file
        .write_all(bytes)
        .map_err(io("writing", &tmp))
        .and_then(|()| file.sync_all().map_err(io("syncing", &tmp)))
        .and_then(|()| fs::rename(&tmp, path).map_err(io("renaming into place", path)));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
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

/// Name of the lock file a save holds in the folder its target lives in.
pub(crate) const LOCK_FILE: &str = ".burn-accelerate.lock";

/// How long a save waits for another save into the same folder to finish before giving up.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// An exclusive advisory lock (`flock`) on `<folder>/.burn-accelerate.lock`, held while a save writes into the
/// folder, so that two writers (two runs sharing a project folder, two threads) never interleave their files or
/// delete each other's unfinished work. The operating system drops it when the process ends, however it ends,
/// so a killed save never leaves a stale lock behind.
#[derive(Debug)]
pub(crate) struct FolderLock {
    _file: File,
}

impl FolderLock {
    /// Locks `folder` for a save of `target`, waiting up to 10 s for another save to finish.
    pub(crate) fn acquire(folder: &Path, target: &Path) -> Result<Self> {
        let path = folder.join(LOCK_FILE);
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("opening the lock file", &path))?;
        let start = std::time::Instant::now();
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(Self { _file: file }),
                Err(fs::TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(fs::TryLockError::WouldBlock) => {
                    return Err(crate::error::Error::Checkpoint {
                        path: target.to_path_buf(),
                        reason: format!(
                            "another save has been writing into {} for over {} s (it holds {}); two runs or \
                             threads must not save into the same folder: give each run its own project folder",
                            folder.display(),
                            LOCK_WAIT.as_secs(),
                            path.display()
                        ),
                    });
                }
                Err(fs::TryLockError::Error(e)) => return Err(io("locking", &path)(e)),
            }
        }
    }
}

/// Asks the kernel to start writing `len` bytes of `file` from `offset` to disk now, without waiting for them
/// (Linux's `sync_file_range`), so that a later `sync_all` finds most of the file already written. A hint:
/// errors are left to that `sync_all` to report; other systems do nothing here.
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // SAFETY: a plain system call on an open descriptor; it reads no memory of ours.
        unsafe {
            libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

/// The CRC-32C of the file at `path`, read a megabyte at a time.
pub(crate) fn file_crc32c(path: &Path) -> Result<u32> {
    use std::io::Read;
    let mut file = File::open(path).map_err(io("reading", path))?;
    let mut buffer = vec![0u8; 1 << 20];
    let mut crc = 0;
    loop {
        let n = file.read(&mut buffer).map_err(io("reading", path))?;
        if n == 0 {
            return Ok(crc);
        }
        crc = crc32c::crc32c_append(crc, &buffer[..n]);
    }
}

/// A scratch file, removed when dropped: beside a checkpoint (on the disk the user chose for checkpoints) or,
/// where that folder cannot be written, in the system's temporary folder.
#[derive(Debug)]
pub(crate) struct Scratch(PathBuf);

impl Scratch {
    /// A new, empty scratch file for a file of kind `what`: beside `near` where that folder takes a new file,
    /// else in the system's temporary folder.
    pub fn create(near: &Path, what: &str) -> Result<Self> {
        let name = Self::name(what);
        let beside = parent_dir(near).join(&name);
        if File::create_new(&beside).is_ok() {
            return Ok(Self(beside));
        }
        let temporary = std::env::temp_dir().join(&name);
        File::create_new(&temporary).map_err(io("creating", &temporary))?;
        Ok(Self(temporary))
    }

    /// A second name for the file at `path`, beside `near` (a hard link: no copy, and the data stays while either
    /// name does, whatever becomes of `near`); `None` where the filesystem refuses.
    pub fn link(path: &Path, near: &Path, what: &str) -> Option<Self> {
        let beside = parent_dir(near).join(Self::name(what));
        fs::hard_link(path, &beside).ok().map(|()| Self(beside))
    }

    /// A fresh name for a scratch file of kind `what`.
    fn name(what: &str) -> String {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        format!(
            ".{what}.scratch.{}.{}.bpk",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}
