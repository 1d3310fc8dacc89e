//! Where one piece of a parameter lies in the whole tensor ([`Piece`]): a saving rank's slice, or the slice a
//! loading rank wants, under any split a checkpoint records: dim-0 slices (FSDP2's `Shard(0)`, a row-split
//! tensor-parallel part), a column-split 2-D weight's part (its columns), and a part sliced again (FSDP2 over a
//! tensor-parallel part: a 2-D split). Each piece is a list of [`Run`]s of consecutive elements of the whole in
//! Burn's row-major layout, so that any saved piece and any wanted piece share what their runs share: a
//! checkpoint saved on one mesh loads on another.

use crate::distributed::strategy::{SliceKind, Slicing};

/// One piece of a parameter's whole tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The whole shape (Burn's layout).
    pub whole: Vec<usize>,
    /// A tensor-parallel part of the whole: the dimension it is cut along (0, or 1 of a 2-D tensor), the number
    /// of parts, and which one; `None`: the whole.
    part: Option<(usize, usize, usize)>,
    /// A slice of the part (of the whole, without a part): its slicing (of the part's shape) and index; `None`: all
    /// of the part.
    slice: Option<(Slicing, usize)>,
}

/// Consecutive elements of a piece: `len` of them, at `whole` in the whole tensor and at `local` in the piece's
/// buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub whole: usize,
    pub local: usize,
    pub len: usize,
}

impl Piece {
    /// The whole tensor of shape `dims`.
    pub fn whole(dims: Vec<usize>) -> Self {
        Self {
            whole: dims,
            part: None,
            slice: None,
        }
    }

    /// Part `part` of `split` (a checkpoint's split: its shape with `dim` first), and, with `within`, piece `q` of
    /// that part split again over `parts` ranks as `kind` says.
    pub fn cut(
        split: &Slicing,
        part: usize,
        dim: usize,
        within: Option<(usize, SliceKind, usize)>,
    ) -> Self {
        let mut whole = split.dims().to_vec();
        if dim == 1 && whole.len() == 2 {
            whole.swap(0, 1);
        }
        if dim == 0 && within.is_none() {
            // Dim-0 slices, whatever split them.
            return Self {
                whole,
                part: None,
                slice: Some((split.clone(), part)),
            };
        }
        let mut piece = Self {
            whole,
            part: Some((dim, split.parts(), part)),
            slice: None,
        };
        piece.slice =
            within.map(|(parts, kind, q)| (Slicing::new(piece.part_dims(), parts, kind), q));
        piece
    }

    /// The shape of the part (the whole's without one).
    fn part_dims(&self) -> Vec<usize> {
        let mut dims = self.whole.clone();
        if let Some((dim, parts, _)) = self.part
            && let Some(d) = dims.get_mut(dim)
        {
            *d /= parts.max(1);
        }
        dims
    }

    /// The shape of the piece's buffer (a slice's padding included).
    pub fn dims(&self) -> Vec<usize> {
        match &self.slice {
            Some((split, q)) => split.local_dims(*q),
            None => self.part_dims(),
        }
    }

    /// The piece's elements as runs of the whole, in order.
    ///
    /// # Errors
    /// A part cut along a dimension other than 0, or 1 of a 2-D tensor (the message says which).
    pub fn runs(&self) -> std::result::Result<Vec<Run>, String> {
        let part_dims = self.part_dims();
        let part_len: usize = part_dims.iter().product();
        let held = match &self.slice {
            Some((split, q)) => split.held(*q),
            None => 0..part_len,
        };
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let one = |whole| {
            vec![Run {
                whole,
                local: 0,
                len: held.len(),
            }]
        };
        match self.part {
            None => Ok(one(held.start)),
            Some((0, _, t)) => Ok(one(t * part_len + held.start)),
            Some((1, _, t)) if self.whole.len() == 2 => {
                // A band of columns: each of its rows is a run of the whole's row.
                let (cols, c) = (self.whole[1], part_dims[1]);
                let mut runs = Vec::new();
                let mut i = held.start;
                while i < held.end {
                    let (r, j) = (i / c, i % c);
                    let len = (c - j).min(held.end - i);
                    runs.push(Run {
                        whole: r * cols + t * c + j,
                        local: i - held.start,
                        len,
                    });
                    i += len;
                }
                Ok(runs)
            }
            Some((dim, _, _)) => Err(format!(
                "a part cut along dimension {dim} of a {}-D tensor (only dimension 0, or 1 of a 2-D tensor)",
                self.whole.len()
            )),
        }
    }
}

/// What two pieces share: `(at in the first's buffer, at in the second's, len)` for each run of elements both
/// hold (runs in order, as [`Piece::runs`] gives them).
pub(crate) fn shared(from: &[Run], to: &[Run]) -> Vec<(usize, usize, usize)> {
    let (mut a, mut b, mut out) = (0, 0, Vec::new());
    while a < from.len() && b < to.len() {
        let (f, t) = (from[a], to[b]);
        let lo = f.whole.max(t.whole);
        let (f_end, t_end) = (f.whole + f.len, t.whole + t.len);
        let hi = f_end.min(t_end);
        if lo < hi {
            out.push((f.local + lo - f.whole, t.local + lo - t.whole, hi - lo));
        }
        if f_end <= t_end {
            a += 1;
        } else {
            b += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of the whole, from every piece of a split: each exactly once, at its own index.
    fn covers_once(pieces: &[Piece], whole: usize) {
        let mut seen = vec![0; whole];
        for piece in pieces {
            for run in piece.runs().unwrap() {
                for n in &mut seen[run.whole..run.whole + run.len] {
                    *n += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }

    #[test]
    fn a_column_part_sliced_again_covers_its_band_of_the_whole_once() {
        // A [6, 4] weight split by columns over 2 (a [4, 6] split with dim 1 first), each [6, 2] part in rows over 4
        // (2, 2, 2, 0 rows: the last slice all padding).
        let split = Slicing::new(vec![4, 6], 2, SliceKind::Rows);
        let pieces: Vec<Piece> = (0..2)
            .flat_map(|t| (0..4).map(move |s| (t, s)))
            .map(|(t, s)| Piece::cut(&split, t, 1, Some((4, SliceKind::Rows, s))))
            .collect();
        covers_once(&pieces, 24);
        // Part 1's second slice: its rows 2 and 3, columns 2 and 3 of the whole.
        assert_eq!(pieces[5].dims(), vec![2, 2]);
        let runs = pieces[5].runs().unwrap();
        assert_eq!(
            runs.iter()
                .map(|r| (r.whole, r.local, r.len))
                .collect::<Vec<_>>(),
            [(10, 0, 2), (14, 2, 2)]
        );
        assert!(pieces[7].runs().unwrap().is_empty());
    }

    #[test]
    fn pieces_of_two_meshes_share_exactly_their_common_elements() {
        // Saved by tp 2 × FSDP 2 (row split), wanted by FSDP 3 alone.
        let rows = Slicing::new(vec![6, 2], 2, SliceKind::Rows);
        let saved: Vec<Piece> = (0..4)
            .map(|k| Piece::cut(&rows, k % 2, 0, Some((2, SliceKind::Rows, k / 2))))
            .collect();
        covers_once(&saved, 12);
        let wanted = Piece::cut(&Slicing::new(vec![6, 2], 3, SliceKind::Rows), 1, 0, None);
        let total: usize = saved
            .iter()
            .map(|p| {
                shared(&p.runs().unwrap(), &wanted.runs().unwrap())
                    .iter()
                    .map(|(_, _, n)| n)
                    .sum::<usize>()
            })
            .sum();
        assert_eq!(total, 4);
        assert_eq!(
            Piece::cut(&rows, 0, 2, None).runs().unwrap_err(),
            "a part cut along dimension 2 of a 2-D tensor (only dimension 0, or 1 of a 2-D tensor)"
        );
    }
}
