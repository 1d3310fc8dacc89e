//! Reading `ACCELERATE_*` and launcher environment variables, with Accelerate's spelling rules.

use crate::error::{Error, Result};

/// Parses a boolean the way Accelerate's `str_to_bool` does.
///
/// Accepted, case-insensitively: `y yes t true on 1` and `n no f false off 0`. Anything else is an error
/// naming `key`.
///
/// ```
/// use burn_accelerate::config::env::parse_bool;
/// assert!(parse_bool("ACCELERATE_USE_CPU", "Yes").unwrap());
/// assert!(!parse_bool("ACCELERATE_USE_CPU", "off").unwrap());
/// assert!(parse_bool("ACCELERATE_USE_CPU", "maybe").is_err());
/// ```
pub fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Ok(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Ok(false),
        _ => Err(Error::config(
            key,
            value,
            "environment",
            "one of y, yes, t, true, on, 1, n, no, f, false, off, 0",
        )),
    }
}

/// Reads an environment variable as an Accelerate flag; unset or empty means `None`.
pub fn flag(key: &str) -> Result<Option<bool>> {
    match std::env::var(key) {
        Ok(value) if !value.trim().is_empty() => parse_bool(key, &value).map(Some),
        _ => Ok(None),
    }
}

/// Reads a non-empty environment variable.
pub fn var(key: &str) -> Option<String> {
    std::env::var(key)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bool_spellings_match_accelerate() {
        for yes in ["y", "YES", "t", "True", "on", "1", " 1 "] {
            assert!(parse_bool("K", yes).unwrap(), "{yes}");
        }
        for no in ["n", "No", "f", "FALSE", "off", "0"] {
            assert!(!parse_bool("K", no).unwrap(), "{no}");
        }
        let err = parse_bool("ACCELERATE_DEBUG_MODE", "2")
            .unwrap_err()
            .to_string();
        assert!(err.contains("ACCELERATE_DEBUG_MODE"), "{err}");
        assert!(err.contains("\"2\""), "{err}");
    }
}
