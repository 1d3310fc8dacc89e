//! Facts about the machine that affect a run.

/// The running kernel's release string (`uname -r`), on Linux.
pub fn kernel_release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| s.trim().to_string())
}

/// This machine's host name (Linux's `/proc/sys/kernel/hostname`, else `$HOSTNAME`, else `localhost`), with
/// anything but letters, digits, `-` and `_` replaced, so it can go into a file name.
pub fn hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into());
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Parses the `major.minor.patch` head of a kernel release such as `5.4.0-150-generic`.
pub fn parse_kernel_version(release: &str) -> Option<(u32, u32, u32)> {
    let head = release
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .next()?;
    let mut parts = head.split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// The oldest Linux kernel on which multi-process runs are known not to hang.
pub const MIN_KERNEL: (u32, u32, u32) = (5, 5, 0);

/// A warning for kernels older than [`MIN_KERNEL`] (Accelerate's Troubleshoot guide: such kernels can make
/// processes hang), or `None`.
pub fn kernel_warning(release: &str) -> Option<String> {
    let version = parse_kernel_version(release)?;
    (version < MIN_KERNEL).then(|| {
        format!(
            "Detected kernel version {release}, which is below the recommended minimum of 5.5.0; this can cause \
             the process to hang. It is recommended to upgrade the kernel to the minimum version or higher."
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions() {
        assert_eq!(parse_kernel_version("5.4.0-150-generic"), Some((5, 4, 0)));
        assert_eq!(parse_kernel_version("6.1.0-28-amd64"), Some((6, 1, 0)));
        assert_eq!(parse_kernel_version("4.19"), Some((4, 19, 0)));
        assert_eq!(parse_kernel_version("nonsense"), None);
        assert!(
            kernel_warning("5.4.0-150-generic")
                .unwrap()
                .contains("5.5.0")
        );
        assert!(kernel_warning("5.5.0").is_none());
        assert!(kernel_warning("6.8.0-1").is_none());
    }
}
