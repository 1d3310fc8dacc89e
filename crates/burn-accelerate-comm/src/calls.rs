//! The one collective-mismatch check. Every engine describes what each rank called at one point of the
//! collective sequence, and debug mode does the same for tensor operations above the engines; [`check_calls`]
//! decides, for all of them, whether the calls can be carried out together, and words the error every rank
//! returns when they cannot.

use crate::{CommError, CommResult};

/// One rank's call at one point of the sequence, as the mismatch check compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSignature {
    /// The collective (`all_reduce`, `barrier`, …) or the tensor operation (`gather`, `reduce`, …).
    pub collective: String,
    /// What every rank must pass alike for the call to proceed (element kind and length, root, shape);
    /// empty when anything goes.
    pub must_agree: String,
    /// How the call reads in a message (`all_reduce (sum) of 4 x f32`).
    pub described: String,
}

impl CallSignature {
    /// A call that agrees with any other call of the same collective.
    pub fn named(collective: impl Into<String>) -> Self {
        let collective = collective.into();
        Self {
            described: collective.clone(),
            collective,
            must_agree: String::new(),
        }
    }
}

/// Checks collective number `seq` across ranks (`calls` in rank order; `None`: a rank whose call could not be
/// read). Different collectives are [`CommError::CollectiveMismatch`]; the same collective with inputs that
/// must agree but do not is [`CommError::IncompatibleInputs`]. Every rank sees the same calls, so every rank
/// returns the same error.
///
/// # Errors
/// As above.
pub fn check_calls(seq: u64, calls: &[Option<CallSignature>]) -> CommResult<()> {
    check_calls_of(seq, calls, &[])
}

/// [`check_calls`] in a sub-group whose rank `r` is world rank `members[r]`: the error names world ranks (an
/// empty `members` is the world itself).
pub fn check_calls_of(
    seq: u64,
    calls: &[Option<CallSignature>],
    members: &[usize],
) -> CommResult<()> {
    let described = || {
        calls
            .iter()
            .enumerate()
            .map(|(r, c)| (members.get(r).copied().unwrap_or(r), c))
            .map(|(r, c)| match c {
                Some(c) => format!("rank {r}: {}", c.described),
                None => format!("rank {r}: an unreadable call header"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(Some(first)) = calls.first() else {
        return Ok(());
    };
    let same_collective = calls
        .iter()
        .all(|c| c.as_ref().is_some_and(|c| c.collective == first.collective));
    if !same_collective {
        return Err(CommError::CollectiveMismatch {
            seq,
            calls: described(),
        });
    }
    let agree = calls
        .iter()
        .flatten()
        .all(|c| c.must_agree == first.must_agree);
    if agree {
        return Ok(());
    }
    Err(CommError::IncompatibleInputs {
        operation: first.collective.clone(),
        reason: format!(
            "collective #{seq}: ranks passed incompatible inputs ({}); every rank must pass a buffer of the same \
             length and dtype (and name the same root)",
            described()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(collective: &str, must_agree: &str) -> Option<CallSignature> {
        Some(CallSignature {
            collective: collective.into(),
            must_agree: must_agree.into(),
            described: format!("{collective} {must_agree}"),
        })
    }

    #[test]
    fn a_sub_group_names_world_ranks() {
        let err = check_calls_of(2, &[call("barrier", ""), call("all_gather", "")], &[1, 3])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 1: barrier") && err.contains("rank 3: all_gather"),
            "{err}"
        );
    }

    #[test]
    fn the_same_call_passes_and_differences_are_named_for_every_rank() {
        assert!(
            check_calls(
                3,
                &[call("all_reduce", "4 f32"), call("all_reduce", "4 f32")]
            )
            .is_ok()
        );
        let different = check_calls(3, &[call("barrier", ""), call("all_gather", "")]).unwrap_err();
        assert!(matches!(
            different,
            CommError::CollectiveMismatch { seq: 3, .. }
        ));
        assert!(
            different
                .to_string()
                .contains("rank 0: barrier , rank 1: all_gather ")
        );
        let incompatible = check_calls(
            7,
            &[call("all_reduce", "4 f32"), call("all_reduce", "5 f32")],
        )
        .unwrap_err();
        assert!(
            incompatible
                .to_string()
                .contains("collective #7: ranks passed incompatible inputs")
        );
        assert!(
            incompatible
                .to_string()
                .contains("rank 1: all_reduce 5 f32")
        );
        let unreadable = check_calls(1, &[call("barrier", ""), None]).unwrap_err();
        assert!(
            unreadable
                .to_string()
                .contains("rank 1: an unreadable call header")
        );
    }
}
